"""The engine's OpenMP thread count, chosen while it runs: n threads, or n - 1.

On an idle machine batch-1 decode is fastest on every core with libgomp's spinning wait; with
another process busy on one core the thread sharing that core stalls every parallel region's
barrier, and one thread fewer is faster than both (docs/performance.md, "A busy core"). The wait
policy is fixed when libgomp loads, but the thread count is not: `torch.set_num_threads` in the
thread that runs the forward sets it for torch's ops and for axon's C kernels, which read
`torch.get_num_threads()` on every call. Outputs do not depend on it (logits are bitwise equal
on 1 and 2 threads), so a switch mid-generation changes no token.

`ThreadCountChooser` is the decision, pure: it is fed the seconds of steps and says which count
the next step runs. It times the count it runs against the other one on a few steps of the same
shape (tokens in the step; steps of another shape are not comparable), keeps the faster by a
margin (the median of a few steps each, so one descheduled step decides nothing; a probe step
far slower than that median ends the probe, lost, at once), and probes again after an interval
that doubles while the choice holds, at once when the chosen count slows down sharply (a load
arrived). `AdaptiveThreads` applies it around each step. Only steps of up to PROBE_TOKENS tokens
(decode) are timed and probed: a prefill step runs the chosen count. A probe lands on whatever
step comes next, and one thread fewer on a long prefill costs far more than a decode step wins;
probing a repeated prefill shape (a 16 x 128-token burst) would cost a second of it.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator

from axon.runner.threads import adaptive_counts

logger = logging.getLogger(__name__)

PROBE_TOKENS = 64  # steps of more tokens (prefill) run the chosen count, untimed


class ThreadCountChooser:
    """Which of two thread counts the next step runs, from the times of past steps.

    `counts`: (the starting count, the alternative). A probe runs `samples` steps on the
    alternative after `samples` steps of the chosen count (the first probe after one); the
    alternative wins when its median is more than `margin` faster (a probe step `slowdown`
    times slower than the chosen count's median ends the probe, lost). The next probe comes
    `interval` steps later: `min_interval` after a switch, doubling up to `max_interval` while
    the choice holds, or as soon as the chosen count's median is `slowdown` times its median at
    the last decision."""

    def __init__(
        self,
        counts: tuple[int, int],
        samples: int = 3,
        margin: float = 0.1,
        min_interval: int = 32,
        max_interval: int = 256,
        slowdown: float = 1.5,
    ):
        self.chosen, self.alternative = counts
        self.samples, self.margin, self.slowdown = samples, margin, slowdown
        self.min_interval, self.max_interval = min_interval, max_interval
        self.interval = min_interval
        self.steps_to_probe = 0  # the first probe as soon as there is a baseline
        self.probing = False
        self.shape: int | None = None
        self.baseline: list[float] = []  # the chosen count's last `samples` steps
        self.trial: list[float] = []  # the alternative's, while probing
        self.reference: float | None = None  # the chosen count's median at the last decision
        self.decided = False  # a probe has been decided

    @property
    def threads(self) -> int:
        """The thread count the next step of the shape being timed should run with."""
        return self.alternative if self.probing else self.chosen

    def threads_for(self, shape: int) -> int:
        """The thread count a step of `shape` tokens should run with: the alternative only on
        the shape being probed (a step of another shape restarts the comparison on the chosen
        count)."""
        return self.threads if shape == self.shape else self.chosen

    def record(self, threads: int, seconds: float, shape: int) -> None:
        """Takes the time of a step that ran `threads` threads on `shape` tokens."""
        if shape != self.shape:
            self._restart(shape)
        if threads != self.threads:
            return  # not the count now asked for (an aborted probe's step): compares with nothing
        if self.probing:
            self.trial.append(seconds)
            # A probe step far slower than the chosen count's median ends the probe at once:
            # the alternative lost (probing a stalled count costs one step, not `samples`).
            lost = seconds > self.slowdown * statistics.median(self.baseline)
            if lost or len(self.trial) == self.samples:
                self._decide(lost)
            return
        self.baseline = [*self.baseline, seconds][-self.samples :]
        self.steps_to_probe -= 1
        # The first probe after one step: under load the starting count's steps can be 20x
        # slower, and three of them cost more than a whole short decode gains.
        if len(self.baseline) < (self.samples if self.decided else 1):
            return
        median = statistics.median(self.baseline)
        if self.reference is None:
            self.reference = median
        if self.steps_to_probe <= 0 or median > self.reference * self.slowdown:
            self.probing, self.trial = True, []

    def _restart(self, shape: int) -> None:
        """Steps of another shape: the times so far compare with nothing that follows."""
        self.shape, self.baseline, self.trial = shape, [], []
        self.probing, self.reference = False, None

    def _decide(self, lost: bool) -> None:
        mine, theirs = statistics.median(self.baseline), statistics.median(self.trial)
        self.probing, self.decided = False, True
        if not lost and theirs < mine * (1 - self.margin):
            logger.debug(
                "OpenMP threads %d -> %d (step %.2f -> %.2f ms)",
                self.chosen,
                self.alternative,
                mine * 1e3,
                theirs * 1e3,
            )
            self.chosen, self.alternative = self.alternative, self.chosen
            self.baseline, self.interval = self.trial, self.min_interval
        else:
            self.interval = min(2 * self.interval, self.max_interval)
        self.trial, self.reference = [], statistics.median(self.baseline)
        self.steps_to_probe = self.interval


class AdaptiveThreads:
    """Runs each step on the chooser's thread count and feeds it the step's time. Use from the
    thread that runs the forward: the OpenMP thread count is that thread's setting."""

    def __init__(self, counts: tuple[int, int], **chooser_args):
        import torch

        self._torch = torch
        self.chooser = ThreadCountChooser(counts, **chooser_args)

    @contextlib.contextmanager
    def step(self, shape: int) -> Iterator[None]:
        """Sets the thread count for the step in the block, then records the block's time
        (not when it raises, nor for a step of more than PROBE_TOKENS tokens)."""
        timed = shape <= PROBE_TOKENS
        threads = self.chooser.threads_for(shape) if timed else self.chooser.chosen
        if self._torch.get_num_threads() != threads:  # the calling thread's OpenMP setting
            self._torch.set_num_threads(threads)
        start = time.perf_counter()
        yield
        if timed:
            self.chooser.record(threads, time.perf_counter() - start, shape)


def for_engine(config, device) -> AdaptiveThreads | None:
    """The adaptive thread count of an engine on `device`, or None: off in the config, not a
    CPU device, several ranks (each would pick its own count), or a count the user set."""
    import torch

    if not config.adaptive_threads or device.type != "cpu" or config.tensor_parallel_size > 1:
        return None
    counts = adaptive_counts(torch.get_num_threads())
    if counts is None:
        return None
    logger.info("OpenMP threads: %d, or %d while that times faster (a busy core)", *counts)
    return AdaptiveThreads(counts)
