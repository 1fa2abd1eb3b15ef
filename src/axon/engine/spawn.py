"""Spawning an engine process, apart from the client that talks to it: `axon serve` spawns its
first model's engine before it imports anything heavy (see server/lifecycle/early_engine.py),
so this module imports nothing but the standard library."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from axon.config import EngineConfig
    from axon.engine.client import Liveness


def _engine_main(source, *args) -> None:
    """The engine process's entry point. It lives here, not in engine_proc, so that spawning
    an engine imports nothing heavy into the HTTP process (spawn pickles the target by name);
    `source` is the EngineConfig, or the (model, engine_args) it is built from."""
    from axon.runner.threads import apply_thread_policy  # lazy: engine process only

    apply_thread_policy()  # first: libgomp reads OMP_* once, when torch loads it
    from axon.config import EngineConfig  # lazy: this module imports only the stdlib
    from axon.engine.engine_proc import engine_process_main  # lazy: torch, engine process only

    if not isinstance(source, EngineConfig):
        model, engine_args = source
        source = EngineConfig.from_kwargs(model, **engine_args)
    engine_process_main(source, *args)


@dataclass
class SpawnedEngine:
    """An engine process spawned and loading, not yet handed to an EngineClient."""

    process: Any  # multiprocessing.Process
    conn: Any  # our end of its pipe
    source: Any  # what it was spawned with: an EngineConfig or (model, engine_args)
    heartbeat_s: float
    env: dict[str, str] = field(default_factory=dict)
    taken: bool = False  # an EngineClient.start owns it (and kills it if the start fails)

    @classmethod
    def spawn(cls, source, liveness: Liveness, env=None, log_level=logging.INFO) -> SpawnedEngine:
        """Starts the engine process for `source` (an EngineConfig, or (model, engine_args):
        then this process need not import the engine stack, torch included, to spawn it)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        args = (source, child, log_level, os.getpid(), liveness.heartbeat_s, env)
        process = ctx.Process(target=_engine_main, args=args, name="axon-engine")
        process.start()
        child.close()
        return cls(process, parent, source, liveness.heartbeat_s, dict(env or {}))

    def adopt(self, config: EngineConfig, liveness: Liveness, env) -> bool:
        """Whether this engine is the one `EngineClient.start(config, liveness, env)` would
        spawn (its config built the same way, the same heartbeat and env)."""
        source = self.source
        if not isinstance(source, tuple):
            return source == config and self._same(liveness, env)
        from axon.config import EngineConfig  # lazy: this module imports only the stdlib

        try:
            built = EngineConfig.from_kwargs(source[0], **source[1])
        except ValueError:
            return False
        return built == config and self._same(liveness, env)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _same(self, liveness: Liveness, env) -> bool:
        return self.heartbeat_s == liveness.heartbeat_s and self.env == dict(env or {})

    def discard(self) -> None:
        """Kills the engine (its whole process group) and closes the pipe."""
        kill_group(self.process)
        self.process.join(5)
        self.conn.close()


def kill_group(process) -> None:
    """SIGKILL the engine's whole process group (every tensor-parallel rank with it)."""
    if process.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(process.pid, signal.SIGKILL)  # before its setpgid, it is in our group
