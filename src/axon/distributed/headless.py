"""`axon serve --headless`: a node other than 0 of a multi-host tensor-parallel model runs its
ranks only (no HTTP): the first in this process, the others spawned. See `multinode`."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

from axon.config import EngineConfig
from axon.distributed import multinode
from axon.distributed.workers import die_with_parent

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig) -> int:
    """`axon serve --headless`: run this node's ranks (the first here, the others spawned)
    until rank 0 shuts them down (0) or goes away (1); returns that exit status. Rank 0 sends
    its engine arguments; only `config.model` (this node's path to the same checkpoint) and
    the rendezvous flags are this node's. Raises ValueError for a node that is not remote."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError(
            "--headless runs node 1.. of several: give --nnodes >= 2, --node-rank >= 1"
        )
    ranks = multinode.node_ranks(config)
    ctx = mp.get_context("spawn")
    others = [
        ctx.Process(target=_remote_process, args=(rank, config, os.getpid()), daemon=True)
        for rank in ranks[1:]
    ]
    for process in others:
        process.start()
    try:
        return _rank_main(ranks[0], config)
    finally:
        for process in others:
            process.join(5)
            if process.is_alive():
                process.kill()


def _remote_process(rank: int, config: EngineConfig, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(message)s")
    try:
        code = _rank_main(rank, config)
    except Exception:  # noqa: BLE001 - its exit breaks the group; rank 0 reports the step
        logger.exception("rank %d failed", rank)
        code = 1
    logging.shutdown()
    os._exit(code)  # no group teardown: the other ranks are exiting too


def _rank_main(rank: int, config: EngineConfig) -> int:
    from axon.runner.tensor_parallel import remote_rank_main  # the model stack: torch, models

    return remote_rank_main(rank, config)
