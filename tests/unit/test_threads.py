"""The engine's CPU thread policy: the user's OpenMP settings win, the thread count follows the
cores this process may use, and the policy reaches libgomp (set before torch loads it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from axon.runner import threads
from axon.runner.threads import apply_thread_policy, choose_policy


def test_an_empty_environment_gets_one_thread_per_core_and_libgomps_own_wait():
    policy = choose_policy({}, cpus=3)
    assert policy.threads == 3
    assert policy.chosen == {"OMP_NUM_THREADS": "3"}
    assert policy.kept == {}


@pytest.mark.parametrize(
    "user",
    [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}],
)
def test_a_users_wait_policy_is_never_overridden(user):
    policy = choose_policy(user, cpus=2)
    assert policy.kept == user
    assert "GOMP_SPINCOUNT" not in policy.chosen and "OMP_WAIT_POLICY" not in policy.chosen
    assert policy.chosen == {"OMP_NUM_THREADS": "2"}


def test_a_users_thread_count_wins_over_the_affinity_mask():
    policy = choose_policy({"OMP_NUM_THREADS": "4,2"}, cpus=2)
    assert policy.threads == 4
    assert "OMP_NUM_THREADS" not in policy.chosen
    assert policy.kept == {"OMP_NUM_THREADS": "4,2"}


def test_binding_set_by_the_user_is_kept_and_none_is_added():
    policy = choose_policy({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, cpus=2)
    assert policy.kept == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    assert not any(key in policy.chosen for key in threads.BIND_KEYS)


def test_an_empty_or_garbled_value_does_not_count_as_set():
    policy = choose_policy({"OMP_NUM_THREADS": "", "GOMP_SPINCOUNT": ""}, cpus=2)
    assert policy.chosen["OMP_NUM_THREADS"] == "2"
    assert "OMP_WAIT_POLICY" not in policy.chosen
    assert choose_policy({"OMP_NUM_THREADS": "many"}, cpus=2).threads == 1


def test_apply_writes_the_choice_and_keeps_the_users(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 5)
    environ = {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    policy = apply_thread_policy(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin", "OMP_NUM_THREADS": "5"}
    assert "OMP_WAIT_POLICY=PASSIVE (user)" in policy.describe()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity masks")
def test_the_thread_count_follows_the_affinity_mask_into_torch():
    """A process pinned to one core runs one torch thread when the policy is applied before
    torch is imported (as the engine process does); the wait is left to libgomp."""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from axon.runner.threads import apply_thread_policy\n"
        "apply_thread_policy()\n"
        "import torch\n"
        "print(torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY', 'unset'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["1", "unset"]


def test_the_engine_process_applies_the_policy_before_torch_loads():
    """The spawned engine's entry point applies the policy while torch (and so libgomp) is
    still unloaded, keeping the user's settings; the engine itself is replaced by a recorder,
    so no model loads."""
    code = (
        "import os, sys, types\n"
        "fake = types.ModuleType('axon.engine.engine_proc')\n"
        "def main(config, *args):\n"
        "    print(os.environ['OMP_WAIT_POLICY'], os.environ['OMP_NUM_THREADS'], seen)\n"
        "fake.engine_process_main = main\n"
        "sys.modules['axon.engine.engine_proc'] = fake\n"
        "from axon.runner import threads\n"
        "real = threads.apply_thread_policy\n"
        "def spy(*a):\n"
        "    global seen\n"
        "    seen = 'torch' in sys.modules\n"
        "    return real(*a)\n"
        "threads.apply_thread_policy = spy\n"
        "from axon.engine.spawn import _engine_main\n"
        "_engine_main(('model.gguf', {}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_NUM_THREADS"] = "3"  # the user's: kept
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # likewise
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["PASSIVE", "3", "False"]
