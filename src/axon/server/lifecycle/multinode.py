"""`axon serve` across hosts: MODEL's tensor-parallel ranks span `--nnodes` hosts. Node 0 is the
HTTP server (its engine is rank 0 and hosts the TCP rendezvous at --master-addr:--master-port);
nodes 1.. run `axon serve --headless`, their ranks only (see `axon.distributed.multinode`).

Node 1 exits when node 0 stops, and a recovered model (poisoned, started again) waits for its
headless nodes to join again: restart them with it (a supervisor's job)."""

from __future__ import annotations

import argparse
import logging
import os

from axon.config import EngineConfig
from axon.server.lifecycle.registry import _start_served_model
from axon.settings import SETTINGS, add_flags

MULTINODE_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port")


def _set(values: dict) -> dict:
    return {key: value for key, value in values.items() if value is not None}


def add_multinode_args(parser: argparse.ArgumentParser) -> None:
    """The multi-host flags of `axon serve`; `multinode_args` and `run_headless_node` read them."""
    group = parser.add_argument_group(
        "multi-host tensor parallelism (torch.distributed's names; MODEL's ranks span hosts)"
    )
    add_flags(group, [SETTINGS[name] for name in MULTINODE_FLAGS])
    group.add_argument(
        "--headless",
        action="store_true",
        help="nodes 1..: run this node's ranks of MODEL only (no HTTP), until node 0 stops",
    )


def multinode_args(ns: argparse.Namespace) -> dict:
    """MODEL's engine arguments for ranks that span hosts, on node 0 (rank 0, the HTTP server):
    {} when no multi-host flag is given. Raises ValueError naming a bad value, for a multi-host
    flag without MODEL, and for a node other than 0 without --headless."""
    flags = _set({name: getattr(ns, name, None) for name in MULTINODE_FLAGS})
    if not flags:
        return {}
    if not ns.model:
        raise ValueError("--nnodes and its flags apply to MODEL: name the model to load")
    if flags.get("node_rank", 0) != 0:
        raise ValueError(f"--node-rank {flags['node_rank']} serves no HTTP: add --headless")
    EngineConfig(model=ns.model, tensor_parallel_size=ns.tensor_parallel_size or 1, **flags)
    return flags


def multinode_starter(served_id: str, engine_args: dict):
    """The registry's model starter with `engine_args` added to the model `served_id`'s (also
    when it is recovered); None when there are none (the registry's own starter)."""
    if not engine_args:
        return None

    async def start(model_id: str, path, args: dict, *rest, **kwargs):
        if model_id == served_id:
            args = {**args, **engine_args}
        return await _start_served_model(model_id, path, args, *rest, **kwargs)

    return start


def run_headless_node(ns: argparse.Namespace) -> int:
    """`axon serve --headless`: this node's ranks of MODEL (a local path to the checkpoint node
    0 loads; node 0 sends the other engine arguments). Returns the exit status: 0 when node 0
    shut the ranks down, 1 when it went away. Raises ValueError for bad flags."""
    if not ns.model or not os.path.exists(ns.model):
        raise ValueError(f"--headless needs MODEL, a local path to node 0's model: {ns.model!r}")
    from axon.runner.rank_main import run_headless  # lazy: torch, --headless only

    flags = {name: getattr(ns, name) for name in ("tensor_parallel_size", *MULTINODE_FLAGS)}
    config = EngineConfig(model=ns.model, **_set(flags))
    logging.basicConfig(
        level=(ns.log_level or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_headless(config)
