"""`axon serve`'s first startup model, its engine spawned before the server stack is imported.

A warm start is two processes' work of seconds each: the engine imports torch and transformers
and loads the weights, the HTTP process imports its stack and loads the tokenizer. Spawning the
engine once the HTTP process listens would put the two one after the other; spawned first, they
run side by side on two cores. The engine is spawned from the spec alone, (path, engine
arguments), and built into an EngineConfig in the child, so nothing heavy is imported here. The
registry's first load of that model takes it over when it asks for the very same engine
(`SpawnedEngine.adopt`), else it is killed and a fresh one started; one never claimed is killed
once the startup loads are done.
"""

from __future__ import annotations

import logging
from pathlib import Path

from axon.engine.client import Liveness
from axon.engine.spawn import SpawnedEngine
from axon.server.config import ServerConfig

logger = logging.getLogger(__name__)


class EarlyEngine:
    """The engine spawned for startup model `model_id`, until the registry claims it."""

    def __init__(self, model_id: str, spawned: SpawnedEngine):
        self.model_id = model_id
        self.spawned: SpawnedEngine | None = spawned

    def claim(self, model_id: str) -> SpawnedEngine | None:
        """The spawned engine, once, to the first load of `model_id`; else None."""
        if model_id != self.model_id:
            return None
        spawned, self.spawned = self.spawned, None
        return spawned

    def discard(self) -> None:
        """Kills the engine when nobody claimed it (its model's load never started)."""
        spawned, self.spawned = self.spawned, None
        if spawned is not None:
            logger.info("the engine spawned early for %s was not used: stopped", self.model_id)
            spawned.discard()

    def starter(self):
        """A registry starter (ServedModel.start's signature) that hands the spawned engine to
        the first load of its model; recoveries (`previous`) and other models start afresh."""

        async def start(model_id: str, *args, **kwargs):
            # lazy: the serving stack loads after the engine is spawned, not before
            from axon.server.lifecycle.served_model import ServedModel

            spawned = None if "previous" in kwargs else self.claim(model_id)
            try:
                return await ServedModel.start(model_id, *args, spawned=spawned, **kwargs)
            except BaseException:
                if spawned is not None and not spawned.taken:
                    spawned.discard()  # the load failed before the engine client took it
                raise

        return start


def spawn_first_model(config: ServerConfig) -> EarlyEngine | None:
    """The first startup model's engine, spawned now when that model is a local file (a GGUF:
    the demo model, `axon serve model.gguf`) on one device, with nothing to resolve; None
    otherwise (directories, repos, quant picks, pinned devices and tensor parallelism load as
    before)."""
    if not config.default_models:
        return None
    spec = config.default_models[0]
    path = Path(spec.model_id)
    if spec.quant or spec.revision or spec.devices or (spec.tensor_parallel or 1) > 1:
        return None
    if not path.is_absolute() or not path.is_file():
        return None
    liveness = Liveness(config.engine_step_timeout_s, config.engine_load_timeout_s)
    spawned = SpawnedEngine.spawn((str(path), config.engine_args(spec)), liveness)
    return EarlyEngine(spec.served_id, spawned)
