"""Tensor parallelism over several hosts: rank layout, the TCP rendezvous and the step channel.

Node k of `nnodes` holds ranks k*L .. k*L+L-1 (L = tensor_parallel_size / nnodes). Node 0's
engine is rank 0 and spawns its own local ranks as on one host (pipes); the other nodes run
`axon serve --headless`. Every rank joins one group through torch's TCP store at
master_addr:master_port (hosted by rank 0). Rank 0 broadcasts each step's pickled input (its
length, then its bytes) on a gloo control group of rank 0 and the ranks on other hosts, which
loop on that broadcast: there is no pipe to another host. A remote rank that fails a step
exits, which breaks the step's collectives on rank 0; one that hangs is caught by the TP
group's timeout (the step deadline, `AXON_TP_STEP_TIMEOUT_S`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from axon.config import EngineConfig


def ranks_per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def node_ranks(config: EngineConfig, node_rank: int | None = None) -> range:
    """The global ranks node `node_rank` (default: this config's node) holds."""
    node = config.node_rank if node_rank is None else node_rank
    local = ranks_per_node(config)
    return range(node * local, (node + 1) * local)


def rendezvous(config: EngineConfig) -> str | None:
    """`tcp://master_addr:master_port` with several nodes; None on one host (a file store)."""
    if config.nnodes == 1:
        return None
    return f"tcp://{config.master_addr}:{config.master_port}"


def control_ranks(config: EngineConfig) -> list[int] | None:
    """Rank 0 and every rank on another node: the members of the step-input broadcast."""
    if config.nnodes == 1:
        return None
    return [0, *range(ranks_per_node(config), config.tensor_parallel_size)]


def send_bytes(payload: bytes, group: dist.ProcessGroup, timeout_s: float) -> None:
    """On rank 0: broadcast `payload` to the control group. Raises RuntimeError when a
    member is gone or has not taken it within `timeout_s`."""
    wait = timedelta(seconds=max(timeout_s, 0.1))  # a zero timeout would mean none at all
    size = torch.tensor([len(payload)], dtype=torch.int64)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # [len(payload)]
    for tensor in (size, data):
        work = dist.broadcast(tensor, src=0, group=group, async_op=True)
        work.wait(timeout=wait)


def receive_bytes(group: dist.ProcessGroup) -> bytes:
    """On a remote rank: the next payload rank 0 broadcasts (waits as long as it takes).
    Raises RuntimeError when rank 0 is gone."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)  # [payload bytes]
    dist.broadcast(data, src=0, group=group)
    return data.numpy().tobytes()
