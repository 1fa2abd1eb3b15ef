"""How a process ended, in words, for the errors that report a lost engine or rank."""

from __future__ import annotations

import signal


def describe_exit(exit_code: int | None) -> str:
    """How a process ended, from its exit code (-N: signal N): `killed by SIGKILL`,
    `exited with code 1`, or `exited (exit status unknown)`."""
    if exit_code is None:
        return "exited (exit status unknown)"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"killed by {name}"
    return f"exited with code {exit_code}"
