"""The engine process: neuron's device worker for one model.

It owns everything on the device (weights, KV cache, scheduler) and serves a FIFO of commands
from the HTTP process over a pipe, stepping the engine whenever work is queued. After a device
fault it is drain-only: every command gets a "poisoned" error and the device is not touched
again; the registry then replaces the whole process.

Messages to the engine:  (kind, call_id, *args)
Messages from it:        ("ready", info) | ("load_failed", message)
                         ("updates", [TokenUpdate]) | ("failed", [request_id], message)
                         ("reply", call_id, ok, payload) | ("poisoned", message)
"""

from __future__ import annotations

import logging
import os
import traceback

import torch

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.engine.faults import InjectedDeviceFault, is_device_fault

logger = logging.getLogger(__name__)


def engine_process_main(config: EngineConfig, conn, log_level: int = logging.INFO) -> None:
    """Entry point of the spawned engine process."""
    os.setpgid(0, 0)  # own process group: the registry can kill every rank at once
    logging.basicConfig(level=log_level, format=f"%(asctime)s engine[{os.getpid()}] %(message)s")
    try:
        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - every load failure is reported, never raised
        conn.send(("load_failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine_info(core)))
    EngineLoop(core, conn).run()


def engine_info(core: EngineCore) -> dict:
    plan = core.runner.plan
    return {
        "max_model_len": core.max_model_len,
        "vocab_size": core.runner.vocab_size,
        "eos_token_ids": sorted(core.eos_token_ids),
        "num_blocks": plan.num_blocks,
        "block_size": plan.block_size,
        "bytes_per_token": plan.bytes_per_token,
        "device": str(core.runner.device),
        "dtype": str(core.runner.dtype).removeprefix("torch."),
        "model_type": core.runner.hf_config.model_type,
    }


class EngineLoop:
    def __init__(self, core: EngineCore, conn):
        self.core = core
        self.conn = conn
        self.poisoned: str | None = None
        self.inject_fault = False
        self.running = True

    def run(self) -> None:
        while self.running:
            idle = self.poisoned is not None or not self.core.has_unfinished()
            self._drain_commands(block=idle)
            if self.running and self.poisoned is None and self.core.has_unfinished():
                self._step()

    def _drain_commands(self, block: bool) -> None:
        timeout = None if block else 0
        while self.running and self.conn.poll(timeout):
            try:
                message = self.conn.recv()
            except EOFError:  # the HTTP process is gone
                self.running = False
                return
            self._handle(message)
            timeout = 0

    def _step(self) -> None:
        try:
            if self.inject_fault:
                raise InjectedDeviceFault()
            updates = self.core.step()
        except Exception as exc:  # noqa: BLE001 - classified below
            self._on_step_error(exc)
            return
        if updates:
            self.conn.send(("updates", updates))

    def _on_step_error(self, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}"
        request_ids = list(self.core.requests)
        self.core.abort(request_ids)
        self.conn.send(("failed", request_ids, message))
        if is_device_fault(exc):
            logger.error("device fault, engine is now drain-only: %s", message)
            self.poisoned = message
            self.conn.send(("poisoned", message))
        else:
            logger.error(
                "step failed (not a device fault): %s\n%s", message, traceback.format_exc()
            )

    # ---- commands ---------------------------------------------------------------------------

    def _handle(self, message: tuple) -> None:
        kind, call_id, *args = message
        if kind == "shutdown":
            self.running = False
            self._reply(call_id, True, None)
            return
        if self.poisoned is not None:
            if kind == "add":
                self.conn.send(("failed", [args[0]], f"model is poisoned: {self.poisoned}"))
            else:
                self._reply(call_id, False, f"poisoned: {self.poisoned}")
            return
        handler = getattr(self, f"_cmd_{kind}", None)
        if handler is None:
            self._reply(call_id, False, f"unknown command {kind!r}")
            return
        try:
            result = handler(*args)
        except Exception as exc:  # noqa: BLE001 - a bad command fails that command only
            self._reply(call_id, False, f"{type(exc).__name__}: {exc}")
            return
        if call_id is not None:
            self._reply(call_id, True, result)

    def _reply(self, call_id, ok: bool, payload) -> None:
        if call_id is not None:
            self.conn.send(("reply", call_id, ok, payload))

    def _cmd_add(self, request_id, prompt_token_ids, params) -> None:
        try:
            self.core.add_request(request_id, prompt_token_ids, params)
        except ValueError as exc:
            self.conn.send(("failed", [request_id], str(exc)))

    def _cmd_abort(self, request_ids) -> None:
        self.core.abort(request_ids)

    def _cmd_stop_sample(self, request_id, index) -> None:
        self.core.stop_sample(request_id, index)

    def _cmd_memory(self) -> tuple[int, int]:
        device = self.core.runner.device
        if device.type != "cuda":
            return (0, 0)  # neuron reports (0, 0) without a CUDA context
        return torch.cuda.mem_get_info(device)

    def _cmd_clear_caches(self) -> None:
        self.core.reset_prefix_cache()
        if self.core.runner.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _cmd_stats(self) -> dict:
        return self.core.stats()

    def _cmd_forward_logits(self, prompts) -> list[list[float]]:
        if self.core.has_unfinished():
            raise ValueError("forward_logits needs an idle engine")
        return [row.tolist() for row in self.core.forward_logits(prompts)]

    def _cmd_inject_fault(self) -> None:
        self.inject_fault = True
