"""The adaptive OpenMP thread count: the decision fed made-up step times (no clock), and the
runner's hook applying it to torch."""

from __future__ import annotations

import pytest
import torch

from axon.runner import threads
from axon.runner.adaptive_threads import AdaptiveThreads, ThreadCountChooser, for_engine

FAST, SLOW = 0.010, 0.014  # seconds of a step: SLOW is within the default slowdown (1.5x)


def run(chooser: ThreadCountChooser, seconds: dict[int, float], steps: int, shape: int = 1):
    """Feeds `steps` steps, each taking `seconds[count]` on the count the chooser asks for;
    returns the counts it asked for, in order."""
    asked = []
    for _ in range(steps):
        count = chooser.threads
        asked.append(count)
        chooser.record(count, seconds[count], shape)
    return asked


def test_an_idle_machine_keeps_every_core_after_one_short_probe():
    chooser = ThreadCountChooser((2, 1), samples=3, min_interval=8)
    asked = run(chooser, {2: FAST, 1: SLOW}, steps=4)
    assert asked == [2, 1, 1, 1]  # the first probe after one step: 3 steps on one thread fewer
    assert run(chooser, {2: FAST, 1: SLOW}, steps=16) == [2] * 16  # next probe waits 16 (8 x 2)
    assert chooser.threads == 1 and chooser.chosen == 2


def test_a_busy_core_switches_to_one_thread_fewer_and_probes_back_later():
    chooser = ThreadCountChooser((2, 1), samples=3, min_interval=8)
    asked = run(chooser, {2: SLOW, 1: FAST}, steps=4 + 8 + 3)
    assert asked[:4] == [2, 1, 1, 1]
    assert chooser.chosen == 1
    assert asked[4:12] == [1] * 8  # min_interval after a switch
    assert asked[12:] == [2, 2, 2]  # the probe back: still slower, so one thread stays
    assert run(chooser, {2: SLOW, 1: FAST}, steps=16) == [1] * 16


def test_the_load_going_away_is_found_at_the_next_probe():
    chooser = ThreadCountChooser((2, 1), samples=3, min_interval=4, max_interval=4)
    run(chooser, {2: SLOW, 1: FAST}, steps=4)
    assert chooser.chosen == 1
    run(chooser, {2: FAST, 1: SLOW}, steps=4 + 3)
    assert chooser.chosen == 2


def test_a_sharp_slowdown_probes_at_once_without_waiting_for_the_interval():
    chooser = ThreadCountChooser(
        (2, 1), samples=3, min_interval=1000, max_interval=4000, slowdown=1.5
    )
    run(chooser, {2: FAST, 1: SLOW}, steps=4)  # the first probe: two threads stay
    assert chooser.steps_to_probe == 2000
    asked = run(chooser, {2: 3 * FAST, 1: SLOW}, steps=6)  # a load arrives: 2 threads 3x slower
    assert asked == [2, 2, 1, 1, 1, 1]  # the median of 3 is slow after 2 slow steps: a probe
    assert chooser.chosen == 1


def test_a_difference_within_the_margin_changes_nothing():
    chooser = ThreadCountChooser((2, 1), samples=3, margin=0.1)
    run(chooser, {2: FAST, 1: FAST * 0.95}, steps=6)
    assert chooser.chosen == 2


def test_one_slow_step_of_the_chosen_count_does_not_decide_a_probe():
    """The medians decide: a step descheduled once is ignored."""
    chooser = ThreadCountChooser((2, 1), samples=3, min_interval=1, max_interval=1)
    run(chooser, {2: FAST, 1: SLOW}, steps=4)  # the first probe: two threads stay
    for count, seconds in [(2, FAST), (2, 10 * SLOW)] + [(1, FAST / 2)] * 3:
        assert chooser.threads == count
        chooser.record(count, seconds, shape=1)
    assert chooser.chosen == 1


def test_a_probe_step_far_slower_than_the_chosen_count_ends_the_probe_at_once():
    """Probing a stalled count (two threads, one on a busy core) costs one step, not three."""
    chooser = ThreadCountChooser((1, 2), samples=3, min_interval=8, slowdown=1.5)
    asked = run(chooser, {1: FAST, 2: 4 * FAST}, steps=2 + 16)
    assert asked == [1, 2] + [1] * 16  # one step of the probe; the interval doubled
    assert chooser.chosen == 1 and chooser.interval == 16


def test_steps_of_another_shape_are_not_compared():
    """A prefill between decode steps restarts the comparison: a 512-token step's time says
    nothing about a 1-token step's."""
    chooser = ThreadCountChooser((2, 1), samples=3)
    run(chooser, {2: FAST, 1: FAST}, steps=2)  # a baseline step and the first probe step
    assert chooser.probing
    chooser.record(1, 100 * SLOW, shape=512)  # another shape: the probe is dropped
    assert not chooser.probing and chooser.baseline == [] and chooser.threads == 2
    assert run(chooser, {2: SLOW, 1: FAST}, steps=4, shape=512) == [2, 1, 1, 1]
    assert chooser.chosen == 1


def test_a_step_on_a_count_not_asked_for_is_ignored():
    chooser = ThreadCountChooser((2, 1), samples=3)
    chooser.record(1, FAST, shape=1)
    assert chooser.baseline == [] and chooser.threads == 2


def test_the_hook_sets_torchs_thread_count_for_the_step_it_times():
    """What the chooser asks for is what torch (and the C kernels, which read
    torch.get_num_threads on each call) runs the step with."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tuner = AdaptiveThreads((2, 1), samples=1)
        seen = []
        for _ in range(3):
            with tuner.step(shape=1):
                seen.append(torch.get_num_threads())
        assert seen == [2, 1, 2 if tuner.chooser.chosen == 2 else 1]
        assert len(tuner.chooser.baseline) == 1  # each step was recorded
    finally:
        torch.set_num_threads(before)


def test_a_step_that_raises_is_not_recorded():
    tuner = AdaptiveThreads((1, 1), samples=3)
    with pytest.raises(RuntimeError), tuner.step(shape=1):
        raise RuntimeError("failed step")
    assert tuner.chooser.baseline == []


class Config:
    adaptive_threads = True
    tensor_parallel_size = 1


@pytest.mark.parametrize(
    ("user", "option", "device", "ranks", "on"),
    [
        ({}, True, "cpu", 1, True),
        ({"OMP_NUM_THREADS": "2"}, True, "cpu", 1, False),  # the user's count wins
        ({}, False, "cpu", 1, False),  # the engine option
        ({}, True, "meta", 1, False),  # not a CPU device
        ({}, True, "cpu", 2, False),  # several ranks
    ],
)
def test_the_engine_adapts_only_a_cpu_count_the_user_did_not_set(
    monkeypatch, user, option, device, ranks, on
):
    monkeypatch.setattr(threads, "_applied", threads.choose_policy(user, cpus=2))
    config = Config()
    config.adaptive_threads, config.tensor_parallel_size = option, ranks
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tuner = for_engine(config, torch.device(device))
    finally:
        torch.set_num_threads(before)
    assert (tuner is not None) == on
    if on:
        assert (tuner.chooser.chosen, tuner.chooser.alternative) == (2, 1)


def test_one_thread_has_nothing_fewer_to_try(monkeypatch):
    monkeypatch.setattr(threads, "_applied", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.adaptive_counts(1) is None
    assert threads.adaptive_counts(4) == (4, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # a user's, in a process axon did not set up
    assert threads.adaptive_counts(4) is None


def test_the_command_line_turns_it_off_and_leaves_the_default_on():
    import argparse

    from axon.cli import add_engine_args, engine_args_from_namespace
    from axon.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    off = engine_args_from_namespace(parser.parse_args(["--model", "m", "--no-adaptive-threads"]))
    assert off["adaptive_threads"] is False
    assert EngineConfig(model="m", **off).adaptive_threads is False
    unset = engine_args_from_namespace(parser.parse_args(["--model", "m"]))
    assert "adaptive_threads" not in unset and EngineConfig(model="m").adaptive_threads


def test_switching_counts_mid_generation_changes_no_token(tiny_model_root, monkeypatch):
    """The runner's hook on a real (tiny) model: steps run on both counts, alternating, and the
    tokens and logprobs equal those of a fixed count."""
    from axon import LLM, SamplingParams
    from tests.model.tiny_models import get_tiny_model, random_prompt

    tiny = get_tiny_model("llama", tiny_model_root)
    llm = LLM(str(tiny.path), dtype="float32", max_model_len=128, kv_cache_memory=2 << 20)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": random_prompt(9, seed=3)}
    before = torch.get_num_threads()
    seen = []
    forward = runner.run_forward
    monkeypatch.setattr(
        runner, "run_forward", lambda batch: seen.append(torch.get_num_threads()) or forward(batch)
    )
    try:
        torch.set_num_threads(1)
        fixed = llm.generate([prompt], params)[0].outputs[0]
        runner.thread_tuner = AdaptiveThreads((2, 1), samples=1, min_interval=1, max_interval=1)
        seen.clear()
        adaptive = llm.generate([prompt], params)[0].outputs[0]
    finally:
        torch.set_num_threads(before)
    assert {1, 2} <= set(seen)
    assert adaptive.token_ids == fixed.token_ids
    assert adaptive.logprobs == fixed.logprobs


def test_a_pending_probe_does_not_land_on_a_step_of_another_shape():
    """The probe waits for a step of the shape it compares: a prefill arriving between decode
    steps runs the chosen count (it ran one thread fewer, 1.7x slower, before)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tuner = AdaptiveThreads((2, 1), samples=3)
        with tuner.step(shape=1):  # the baseline step: the probe is now pending
            pass
        assert tuner.chooser.probing
        with tuner.step(shape=7):  # another small shape: the chosen count, the probe dropped
            assert torch.get_num_threads() == 2
        assert tuner.chooser.shape == 7 and len(tuner.chooser.baseline) == 1  # compared afresh
        assert tuner.chooser.trial == []
    finally:
        torch.set_num_threads(before)


def test_prefill_steps_run_the_chosen_count_untimed():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tuner = AdaptiveThreads((2, 1), samples=3)
        with tuner.step(shape=1):
            pass
        for _ in range(3):  # the same prefill shape again and again: never probed, never timed
            with tuner.step(shape=512):
                assert torch.get_num_threads() == 2
        assert tuner.chooser.probing and tuner.chooser.shape == 1  # still waiting for a decode step
        with tuner.step(shape=1):  # where the probe runs
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
