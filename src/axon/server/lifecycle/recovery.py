"""Recovery of a model whose engine faulted: a fresh engine from the retained spec and files.

Recovery is single-flight per fault. A start that fails (a model file gone or broken for a
while, a device still busy) is retried with exponential backoff: `recovery_attempts` starts in
all, the first at once, the next after `recovery_backoff_s`, doubling each time up to
RECOVERY_MAX_DELAY_S. Meanwhile the model is `recovering` (`GET /models` and `/health` show the
attempt and the last failure); after the last attempt it is `failed` with the reason and stays
so until it is unloaded (or loaded again), so that a client gets the reason, not a 404.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

RECOVERY_MAX_DELAY_S = 60.0


def retry_delay_s(attempt: int, first_delay_s: float) -> float:
    """Seconds to wait before start number `attempt` (1-based; the first is at once)."""
    if attempt <= 1:
        return 0.0
    return min(RECOVERY_MAX_DELAY_S, first_delay_s * 2 ** (attempt - 2))


class Recovery:
    """ModelRegistry's recovery half; it uses the registry's `_entries`, `_start_model`,
    `config` and `closed`."""

    _entries: dict[str, Any]
    config: Any
    closed: bool

    def _on_poisoned(self, model_id: str, model, reason: str) -> None:
        """Starts recovery of the model whose engine `model` faulted; once per fault."""
        entry = self._entries.get(model_id)
        if entry is None or entry.model is not model or entry.task is not None or self.closed:
            return
        logger.error("model %s poisoned (%s); recovering", model_id, reason)
        entry.status = "poisoned"
        entry.task = asyncio.get_running_loop().create_task(self._recover(model_id, entry))
        entry.task.add_done_callback(retrieve_exception)

    async def _recover(self, model_id: str, entry) -> None:
        """Kills the faulted engine, then starts fresh ones until one is up or the attempts
        are spent (the model is then `failed`)."""
        entry.status = "recovering"
        old, entry.model = entry.model, None
        try:
            old.kill()  # the device state is unknown: kill the whole process group at once
            await old.shutdown(0.0)  # reaps it; its requests have already failed
        except Exception as exc:
            logger.warning("stopping the faulted engine of %s failed: %r", model_id, exc)
        try:
            model = await self._start_with_retries(model_id, entry, old)
        finally:
            entry.task = None
        if model is None:
            return
        if self._entries.get(model_id) is not entry:  # unloaded while recovering
            await model.shutdown(0.0)
            return
        entry.model, entry.status, entry.error = model, "loaded", None
        entry.attempt = 0
        logger.info("model %s recovered", model_id)

    async def _start_with_retries(self, model_id: str, entry, old):
        attempts = self.config.recovery_attempts
        for attempt in range(1, attempts + 1):
            await asyncio.sleep(retry_delay_s(attempt, self.config.recovery_backoff_s))
            entry.attempt = attempt
            try:
                return await self._start_model(model_id, entry, previous=old)
            except Exception as exc:
                why = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                entry.error = f"recovery attempt {attempt} of {attempts} failed: {why}"
                logger.error("model %s: %s", model_id, entry.error)
        entry.status = "failed"
        logger.error("model %s failed: recovery gave up after %d attempts", model_id, attempts)
        return None


def retrieve_exception(task: asyncio.Task) -> None:
    # The load's caller may have gone; its failure is logged here rather than as an
    # "exception was never retrieved" warning.
    if not task.cancelled() and task.exception() is not None:
        logger.debug("background task %s failed: %r", task.get_name(), task.exception())
