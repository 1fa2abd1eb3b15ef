"""Tensor-parallel ranks 1..N-1, the side that is not rank 0: what each rank program runs (it is
named to the rank program by `tensor_parallel.RANK_TARGET`), and `axon serve --headless`, the
ranks of a node other than 0 (see distributed/multinode.py).

A rank on rank 0's host takes each step from its pipe and answers it; a rank on another host
takes each step from rank 0's broadcast and sends nothing back. Both run the same forward as
rank 0 and meet it in the all-reduces.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time

import torch

from axon.config import EngineConfig
from axon.distributed import multinode
from axon.distributed.parallel_state import control_group, init_tp_group
from axon.distributed.rank_process import start_rank
from axon.distributed.workers import move_tensors
from axon.kernels import build
from axon.runner.disk_shard import DiskShards
from axon.runner.model_runner import ModelRunner
from axon.runner.tensor_parallel import rank_device

logger = logging.getLogger(__name__)


def worker_main(rank: int, store_path: str, conn, parent_pid: int, config, threads, level, timeout):
    """Rank `rank` (1..N-1) on rank 0's host: join the group, load this rank's shard, then run
    every step rank 0 sends until it says shutdown (or goes away)."""
    torch.set_num_threads(threads)
    logging.basicConfig(level=level, format=f"%(asctime)s tp-rank{rank}[{os.getpid()}] %(message)s")
    try:
        device = rank_device(config, rank)
        conn.send(("joining",))
        control = multinode.control_ranks(config)
        size = config.tensor_parallel_size
        init_tp_group(store_path, rank, size, device, timeout, control_ranks=control)
        runner = ModelRunner(config, rank=rank, on_loaded=lambda: conn.send(("loaded",)))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the load
        logger.exception("rank %d failed to load", rank)
        conn.send(("load_failed", f"{type(exc).__name__}: {exc}"))
        return
    if device.type == "cpu":
        build.load()  # before the first step, as the engine process does
    _serve_steps(runner, conn, DiskShards(config, runner, rank))
    logging.shutdown()
    # Straight out: tearing the group down (or torch's exit handlers) would wait on the ranks
    # that are exiting too; the kernel frees what this process holds.
    os._exit(0)


def _serve_steps(runner, conn, disk: DiskShards) -> None:
    """Wait on the pipe (never on a collective with a timeout) and run each step sent."""
    image_outputs: dict = {}  # request key -> this rank's tower output for its images
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # rank 0 is gone
        if message[0] == "shutdown":
            disk.close()
            conn.send(("bye",))
            return
        if message[0] == "disk":
            conn.send(disk.answer(message[1:]))
            continue
        if message[0] == "wedge":
            _wedge()
        try:
            batch = message[1]
            if runner.device.type != "cpu":
                batch = move_tensors(batch, runner.device)
            runner.run_forward(resolve_images(runner, batch, image_outputs))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the step
            logger.exception("step failed")
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("ok",))


def _wedge() -> None:
    """The watchdog test's hung rank: blocks like a collective that never returns."""
    logger.warning("debug hook: this rank's next step never returns")
    while True:
        time.sleep(3600)


def resolve_images(runner, batch, outputs: dict):
    """`batch` with the image rows' values from this rank's own tower run on the pixels rank 0
    sent (kept in `outputs` by key until the request's last image part)."""
    if not batch.image_takes:
        return batch
    values, deepstack, done = [], [], []
    for key, pixels, start, stop, last in batch.image_takes:
        if pixels is not None:
            outputs[key] = runner.encode_images(pixels[0], pixels[1], with_deepstack=True)
        embeds, features = outputs[key]
        values.append(embeds[start:stop])
        if features is not None:
            deepstack.append(features[:, start:stop])
        if last:
            done.append(key)
    for key in done:
        outputs.pop(key, None)
    stacked = torch.cat(deepstack, dim=1) if deepstack else None
    return dataclasses.replace(batch, image_values=torch.cat(values), image_deepstack=stacked)


def run_headless(config: EngineConfig) -> int:
    """`axon serve --headless`: run this node's ranks (the first here, the others as rank
    programs) until rank 0 shuts them down (0) or goes away (1); returns that exit status.
    Rank 0 sends its engine arguments; only `config.model` (this node's path to the same
    checkpoint) and the rendezvous flags are this node's. Raises ValueError for a node that
    is not remote."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError(
            "--headless runs node 1.. of several: give --nnodes >= 2, --node-rank >= 1"
        )
    ranks = multinode.node_ranks(config)
    rendezvous = multinode.rendezvous(config)
    others = [start_rank(_remote_process, rank, rendezvous, (config,)) for rank in ranks[1:]]
    for _, conn in others:
        conn.close()  # they take their steps from rank 0's broadcast
    try:
        return remote_rank_main(ranks[0], config)
    finally:
        for process, _ in others:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(1)


def _remote_process(rank: int, rendezvous: str, conn, parent_pid: int, config) -> None:
    """A headless node's rank after its first, in its own rank program."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(message)s")
    try:
        code = remote_rank_main(rank, config)
    except Exception:  # noqa: BLE001 - its exit breaks the group; rank 0 reports the step
        logger.exception("rank %d failed", rank)
        code = 1
    logging.shutdown()
    os._exit(code)  # no group teardown: the other ranks are exiting too


def remote_rank_main(rank: int, config: EngineConfig) -> int:
    """Rank `rank` on a node other than 0: join the group over TCP, take rank 0's engine
    arguments, load this rank's shard, then run every step rank 0 broadcasts. Returns 0 when
    rank 0 shuts the ranks down, 1 when it is gone or a step failed here."""
    timeout = config.tp_step_timeout_s
    device = rank_device(config, rank)
    init_tp_group(
        multinode.rendezvous(config),
        rank,
        config.tensor_parallel_size,
        device,
        timeout,
        control_ranks=multinode.control_ranks(config),
    )
    control = control_group()
    sent = pickle.loads(multinode.receive_bytes(control))
    config = dataclasses.replace(sent, model=config.model, node_rank=config.node_rank)
    logger.info(
        "rank %d joined %d ranks: loading %s", rank, config.tensor_parallel_size, config.model
    )
    runner = ModelRunner(config, rank=rank)
    if device.type == "cpu":
        build.load()  # before the first step, as the engine process does
    return _serve_broadcast_steps(runner, control)


def _serve_broadcast_steps(runner, control) -> int:
    """Run each step rank 0 broadcasts. A failed step ends this rank: there is no reply
    channel, and its exit breaks the step's collectives on rank 0 (a process-group fault)."""
    image_outputs: dict = {}  # request key -> this rank's tower output for its images
    while True:
        try:
            message = pickle.loads(multinode.receive_bytes(control))
        except RuntimeError as exc:
            logger.warning("rank 0 is gone (%s): exiting", exc)
            return 1
        if message[0] == "shutdown":
            logger.info("rank 0 shut the ranks down")
            return 0
        try:
            batch = message[1]
            if runner.device.type != "cpu":
                batch = move_tensors(batch, runner.device)
            runner.run_forward(resolve_images(runner, batch, image_outputs))
        except Exception:  # noqa: BLE001 - see the docstring
            logger.exception("step failed: leaving the group")
            return 1
