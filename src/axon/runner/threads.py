"""The CPU thread policy of an engine process: how many OpenMP threads, and how idle ones wait.

axon's CPU decode runs many short OpenMP parallel regions per token (the C kernels and torch's
ops share torch's libgomp). Between regions libgomp's idle threads spin (~300,000 iterations)
before sleeping. On an idle machine that spin is what keeps batch-1 decode fast: the gap between
two regions (Python between C calls) is long, and a thread that went to sleep costs a futex wake
per region (OMP_WAIT_POLICY=PASSIVE, or a short spin count, decodes slower there). On a machine
where another process is busy on one core the spin turns against us: the thread sharing that
core burns its slice spinning and every barrier waits for it, and PASSIVE is the faster wait
(docs/performance.md, "A busy core"). No single wait setting wins both, so the engine keeps
libgomp's default wait and changes the thread count instead, while it runs: one thread fewer
than cores when that times faster (a busy core), all of them otherwise (`adaptive_threads.py`;
`adaptive_counts` below says when). A user who sets OMP_NUM_THREADS turns that off.

What axon chooses is the thread count: the cores in this process's affinity mask (taskset, a
cgroup cpuset), not the machine's count. libgomp reads its environment once, when it is loaded
(by `import torch`), so the policy is applied to `os.environ` before that: first thing in the
spawned engine process, and in the benchmark's worker. Whatever the user set (OMP_NUM_THREADS,
OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_PROC_BIND, GOMP_CPU_AFFINITY) is kept as it is. Threads are
not pinned: pinning would hold a thread on a core another process is busy on, where the
scheduler could otherwise move it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
BIND_KEYS = ("OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "OMP_PLACES")
THREAD_KEYS = ("OMP_NUM_THREADS",)


@dataclass(frozen=True)
class ThreadPolicy:
    """What an engine process runs with. `chosen`: the variables axon sets; `kept`: the ones
    the user had set, left alone."""

    threads: int
    chosen: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{self.threads} OpenMP threads"]
        parts += [f"{key}={value}" for key, value in self.chosen.items()]
        parts += [f"{key}={value} (user)" for key, value in self.kept.items()]
        return ", ".join(parts)


def choose_policy(environ: Mapping[str, str], cpus: int) -> ThreadPolicy:
    """The policy for a process that may run on `cpus` cores, given its environment. Pure: it
    changes nothing. A user's OMP_*/GOMP_* setting always wins over axon's choice."""
    kept = {k: environ[k] for k in (*THREAD_KEYS, *WAIT_KEYS, *BIND_KEYS) if environ.get(k)}
    chosen = {}
    if "OMP_NUM_THREADS" not in kept:
        chosen["OMP_NUM_THREADS"] = str(max(1, cpus))
    threads = _first_int(kept.get("OMP_NUM_THREADS")) or int(chosen.get("OMP_NUM_THREADS", 1))
    return ThreadPolicy(threads=threads, chosen=chosen, kept=kept)


def _first_int(value: str | None) -> int | None:
    """OMP_NUM_THREADS may be a list ("4,2": nested levels); the first level is ours."""
    try:
        return max(1, int(value.split(",")[0])) if value else None
    except ValueError:
        return None


def adaptive_counts(threads: int) -> tuple[int, int] | None:
    """(threads, threads - 1), the counts the engine may switch between while it runs
    (`adaptive_threads.py`), for a process now running `threads` OpenMP threads; None when the
    user set OMP_NUM_THREADS (their count always wins) or there is no fewer to try."""
    user = _applied.kept if _applied is not None else os.environ
    if user.get("OMP_NUM_THREADS") or threads < 2:
        return None
    return threads, threads - 1


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a cgroup
    cpuset), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def apply_thread_policy(environ: MutableMapping[str, str] | None = None) -> ThreadPolicy:
    """Chooses the policy and writes it into `environ` (default os.environ), then logs it.
    Returns the policy. Call before torch is imported: libgomp reads these once, at load."""
    environ = os.environ if environ is None else environ
    policy = choose_policy(environ, available_cpus())
    environ.update(policy.chosen)
    if "torch" in sys.modules:  # too late for the wait policy; the thread count still applies
        import torch

        torch.set_num_threads(policy.threads)
        logger.warning("thread policy applied after torch was imported: waiting unchanged")
    global _applied
    _applied = policy
    log_thread_policy()
    return policy


_applied: ThreadPolicy | None = None


def log_thread_policy() -> None:
    """Logs the policy this process applied (again, once its logging is set up)."""
    if _applied is not None:
        logger.info("CPU thread policy: %s", _applied.describe())
