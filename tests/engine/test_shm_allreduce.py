"""The shared-memory all-reduce of CPU tensor-parallel ranks on one host: real rank processes
joined through `init_tp_group`, compared with gloo and with a torch sum in rank order."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from axon.distributed import parallel_state as ps
from axon.distributed.shm_allreduce import ShmCollectiveError, round_slot

SLOT_BYTES = 64 * 128 * 4  # 128 tokens x 64 hidden x fp32
CASES = [  # (dtype, shape): the last one is larger than a slot and goes over gloo
    (torch.float32, (1, 64)),
    (torch.float32, (7, 1000)),
    (torch.bfloat16, (3, 64)),
    (torch.float16, (128, 64)),
    (torch.float32, (129, 64)),
]
BACK_TO_BACK = 300


def rank_input(rank: int, dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Rank `rank`'s tensor: mixed magnitudes, so the order of the adds shows in the bits."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    scale = 10.0 ** torch.randint(-3, 4, shape, generator=gen)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def in_rank_order(world: int, dtype, shape, seed: int) -> torch.Tensor:
    total = rank_input(0, dtype, shape, seed)
    for rank in range(1, world):
        total = total + rank_input(rank, dtype, shape, seed)
    return total


def _correctness(rank: int, world: int) -> dict:
    out = {"path": ps.tp_allreduce_path(), "fits": [], "reduced": [], "gloo": [], "gathered": []}
    for seed, (dtype, shape) in enumerate(CASES):
        x = rank_input(rank, dtype, shape, seed)
        out["fits"].append(ps._SHM.fits(x))
        via_gloo = x.clone()
        dist.all_reduce(via_gloo)
        out["reduced"].append(ps.tp_all_reduce(x.clone()))
        out["gloo"].append(via_gloo)
        out["gathered"].append(ps.tp_all_gather(x, dim=-1))
    wrong = 0
    for call in range(BACK_TO_BACK):  # every call reuses a slot two calls old
        size = 1 + call % 97
        x = torch.full((size,), float(call * (rank + 1)))
        wrong += int(not torch.equal(ps.tp_all_reduce(x), torch.full((size,), float(call * 6))))
    out["back_to_back_wrong"] = wrong
    out["segment_exists"] = os.path.exists(ps._SHM.path)
    with open("/proc/self/maps") as maps:
        out["mapped_deleted"] = f"{ps._SHM.path} (deleted)" in maps.read()
    return out


def _dies(rank: int, world: int) -> dict:
    ps.tp_all_reduce(torch.ones(8))  # one good call first: the failure is mid-stream
    ps._SHM.timeout_s = 60.0  # the error must come from the liveness check, not the deadline
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        ps.tp_all_reduce(torch.ones(8))
    except ShmCollectiveError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None}


def _hangs(rank: int, world: int) -> dict:
    ps._SHM.timeout_s = 1.0
    if rank == 1:
        time.sleep(30)  # alive, but never joins the collective
    start = time.monotonic()
    try:
        ps.tp_all_reduce(torch.ones(8))
    except ShmCollectiveError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None}


def _forced_gloo(rank: int, world: int) -> dict:
    x = ps.tp_all_reduce(torch.full((4, 64), float(rank + 1)))
    return {"path": ps.tp_allreduce_path(), "sum": x}


SCENARIOS = {f.__name__: f for f in (_correctness, _dies, _hangs, _forced_gloo)}


def _rank_main(rank, world, store_path, scenario, env, results) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    ps.init_tp_group(store_path, rank, world, torch.device("cpu"), 60.0, SLOT_BYTES)
    try:
        # Plain pickle: tensors travel inline, not as shared-memory handles of a rank that exits.
        results.put(pickle.dumps((rank, os.getpid(), SCENARIOS[scenario](rank, world))))
    finally:
        ps.destroy_tp_group()
        results.put(pickle.dumps((rank, "destroyed", None)))
        results.close()
        results.join_thread()  # flushed before the hard exit below
    os._exit(0)  # no teardown that could wait on a rank that is gone


def run_ranks(tmp_path, world: int, scenario: str, env=None, wait_s: float = 120.0):
    """Run `scenario` on `world` rank processes; returns ({rank: result}, pids, processes)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_path = str(tmp_path / f"store-{scenario}")
    args = (world, store_path, scenario, env or {}, results)
    procs = [
        ctx.Process(target=_rank_main, args=(rank, *args), daemon=True) for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    got, pids, deadline = {}, {}, time.monotonic() + wait_s
    silent = {1} if scenario in ("_dies", "_hangs") else set()  # rank 1 never reports
    while len(got) < world - len(silent) and time.monotonic() < deadline:
        message = results.get(timeout=max(0.1, deadline - time.monotonic()))
        rank, pid, value = pickle.loads(message)
        if pid != "destroyed":
            got[rank], pids[rank] = value, pid
    for rank, proc in enumerate(procs):
        # The ranks that reported exit once their group is destroyed; the hung one sleeps on,
        # and nothing is left to learn from it: killed at once, not after a join's timeout.
        proc.join(0 if rank in silent else 5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return got, pids


def segments_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/axon-tp-{pid}-*")


def test_backend_setting_is_validated():
    assert ps.allreduce_backend({}) == "shm"
    assert ps.allreduce_backend({"AXON_TP_ALLREDUCE": " GLOO "}) == "gloo"
    with pytest.raises(ValueError, match="AXON_TP_ALLREDUCE must be shm or gloo, got 'tcp'"):
        ps.allreduce_backend({"AXON_TP_ALLREDUCE": "tcp"})


def test_three_ranks_sum_in_rank_order(tmp_path):
    world = 3
    got, pids = run_ranks(tmp_path, world, "_correctness")
    assert sorted(got) == [0, 1, 2]
    assert {r["path"] for r in got.values()} == {"shm"}
    assert got[0]["fits"] == [True, True, True, True, False]  # the last one went over gloo
    for index, (dtype, shape) in enumerate(CASES):
        expected = in_rank_order(world, dtype, shape, index)
        gathered = torch.cat([rank_input(r, dtype, shape, index) for r in range(world)], dim=-1)
        for rank in range(world):
            reduced = got[rank]["reduced"][index]
            assert reduced.dtype == dtype and reduced.shape == shape
            if got[0]["fits"][index]:  # bit-identical to (x0 + x1) + x2 on every rank
                assert torch.equal(reduced, expected), (rank, dtype, shape)
            assert torch.equal(reduced, got[0]["reduced"][index])
            # gloo adds in its own order: equal up to rounding.
            bound = sum(rank_input(r, dtype, shape, index).float().abs() for r in range(world))
            slack = 1e-5 if dtype == torch.float32 else 1e-2
            assert (
                (reduced.float() - got[rank]["gloo"][index].float()).abs() <= slack * bound
            ).all()
            assert torch.equal(got[rank]["gathered"][index], gathered)
    assert [r["back_to_back_wrong"] for r in got.values()] == [0, 0, 0]
    # Unlinked once every rank had mapped it: still mapped, no name left behind.
    assert all(not r["segment_exists"] and r["mapped_deleted"] for r in got.values())
    assert segments_of(pids[0]) == []


def test_two_ranks_equal_gloo_bit_for_bit(tmp_path):
    got, _ = run_ranks(tmp_path, 2, "_correctness")
    for index in range(len(CASES)):
        for rank in (0, 1):
            assert torch.equal(got[rank]["reduced"][index], got[rank]["gloo"][index])


def test_a_killed_rank_is_an_error_not_a_hang(tmp_path):
    got, pids = run_ranks(tmp_path, 2, "_dies")
    assert list(got) == [0]
    assert got[0]["error"] is not None
    assert "rank 1" in got[0]["error"] and "died" in got[0]["error"]
    assert "process group" in got[0]["error"]  # the engine's fault check poisons the model
    assert got[0]["elapsed"] < 10.0  # the liveness check, long before the 60 s deadline
    assert segments_of(pids[0]) == []


def test_a_hung_rank_misses_the_deadline(tmp_path):
    got, pids = run_ranks(tmp_path, 2, "_hangs", wait_s=60.0)
    assert "missed the 1 s deadline" in got[0]["error"]
    assert "ranks [1]" in got[0]["error"]
    assert 1.0 <= got[0]["elapsed"] < 10.0
    assert segments_of(pids[0]) == []


def test_gloo_can_be_forced(tmp_path):
    got, pids = run_ranks(tmp_path, 2, "_forced_gloo", env={"AXON_TP_ALLREDUCE": "gloo"})
    assert [got[r]["path"] for r in (0, 1)] == ["gloo", "gloo"]
    assert torch.equal(got[1]["sum"], torch.full((4, 64), 3.0))
    assert segments_of(pids[0]) == []


def test_engine_ranks_default_to_shared_memory(tiny_model_root):
    """The engine's TP=2 CPU group reduces through a segment sized for its largest reduce:
    [max_num_batched_tokens, hidden] fp32 (tests/engine/test_tensor_parallel.py checks the
    logits and tokens through it)."""
    # Imported here, not at the top: every spawned rank of the other tests imports this module,
    # and the engine and transformers' model classes would cost each of them ~3 CPU-seconds.
    from axon import LLM
    from tests.model.tiny_models import get_tiny_model

    tiny = get_tiny_model("qwen3", tiny_model_root)
    llm = LLM(str(tiny.path), tensor_parallel_size=2, dtype="float32", max_num_batched_tokens=16)
    try:
        assert ps.tp_allreduce_path() == "shm"
        assert ps._SHM.slot_bytes == round_slot(16 * 64 * 4)
        assert segments_of(os.getpid()) == []
    finally:
        llm.engine.close()
    assert ps.tp_allreduce_path() == "none"
