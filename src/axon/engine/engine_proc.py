"""The engine process: neuron's device worker for one model.

It owns everything on the device (weights, KV cache, scheduler) and serves a FIFO of messages
from the HTTP process over a pipe (the protocol: axon.engine.messages), stepping the engine
whenever work is queued. After a device fault it is drain-only: every message but a shutdown
fails with a "poisoned" error and the device is not touched again; the registry then replaces
the whole process.

Liveness: the loop sends something at least every `heartbeat_s` (a step's updates, else a
heartbeat), so the HTTP process can tell a wedged step (or a stopped process) from a slow one by
silence alone. The engine dies with the HTTP process: a parent-death signal (Linux) and a watch
on the parent pid, so a killed server leaves no orphan holding device memory.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import torch

from axon.config import EngineConfig
from axon.distributed.rank_process import die_with_parent
from axon.engine.engine_core import EngineCore
from axon.engine.faults import InjectedDeviceFault, is_device_fault
from axon.engine.messages import (
    Abort,
    AddRequest,
    Call,
    Failed,
    Heartbeat,
    LoadFailed,
    LoadProgress,
    MalformedMessage,
    Message,
    Poisoned,
    Ready,
    Reply,
    StopSample,
    Updates,
    decode,
    encode,
)
from axon.kernels import build
from axon.loader import progress
from axon.models.weights import parameter_bytes
from axon.runner.heap import release_freed_heap
from axon.runner.threads import log_thread_policy

logger = logging.getLogger(__name__)


def engine_process_main(
    config: EngineConfig,
    conn,
    log_level: int = logging.INFO,
    parent_pid: int | None = None,
    heartbeat_s: float = 1.0,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of the spawned engine process. `env` is applied before the device is first
    touched (CUDA_VISIBLE_DEVICES pins the engine to its devices)."""
    os.setpgid(0, 0)  # own process group: the registry can kill every rank at once
    os.environ.update(env or {})
    if parent_pid is not None:
        die_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format=f"%(asctime)s engine[{os.getpid()}] %(message)s")
    log_thread_policy()
    progress.set_reporter(lambda loaded, total: send(conn, LoadProgress(loaded, total)))
    try:
        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - every load failure is reported, never raised
        send(conn, LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    _compile_kernels(core)
    if core.runner.workers is not None:
        core.runner.workers.watch(_on_rank_death)
    send(conn, Ready(engine_info(core)))
    try:
        EngineLoop(core, conn, heartbeat_s).run()
    finally:
        core.close()  # the other tensor-parallel ranks exit with the engine


def send(conn, message: Message) -> None:
    """Sends one message (axon.engine.messages) down the pipe."""
    conn.send_bytes(encode(message))


def _on_rank_death(rank: int, exit_code: int | None) -> None:
    """A tensor-parallel rank died: the group is broken and rank 0 may be inside a collective
    that will never return. Kill the engine's whole process group (this process and every
    rank, the group made in engine_process_main); the HTTP process sees the engine die, fails
    its requests and recovers the model in fresh processes."""
    logger.error("tensor-parallel rank %d died (exit code %s): stopping all", rank, exit_code)
    logging.shutdown()
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _compile_kernels(core: EngineCore) -> None:
    """Builds the CPU kernel library now (once per machine, cached), inside the load deadline,
    so that the first step is not mistaken for a wedged one."""
    if core.runner.device.type == "cpu":
        build.load()


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
        "activation_precision": core.runner.config.activation_precision,  # auto resolved
        "model_type": core.runner.hf_config.model_type,
        "parameter_bytes": parameter_bytes(core.runner.model),  # {"total", "active"}
        "vision": vision_info(core),
        "task": core.task,
        "pooling": core.pooler.config.info() if core.pooler is not None else None,
        "hidden_size": core.runner.text_config.hidden_size,
    }


def vision_info(core: EngineCore) -> dict | None:
    """What the HTTP process needs to prepare images for this engine: the placeholder token
    ids, the merge size and the engine's image limits; None without a vision tower."""
    model, config = core.runner.model, core.config
    if getattr(model, "visual", None) is None:
        return None
    return {
        "image_token_id": model.image_token_id,
        "vision_start_token_id": model.vision_start_token_id,
        "spatial_merge_size": model.spatial_merge_size,
        "max_images_per_prompt": config.max_images_per_prompt,
        "max_image_pixels": config.max_image_pixels,
        "image_profile": config.image_profile,
    }


class EngineLoop:
    def __init__(self, core: EngineCore, conn, heartbeat_s: float = 1.0):
        self.core = core
        self.conn = conn
        self.heartbeat_s = heartbeat_s
        self.poisoned: str | None = None
        self.inject_fault = False
        self.inject_hang = False
        self.running = True
        self.last_sent = time.monotonic()
        # Structured-output requests waiting for the grammar backend's first build, which can
        # take seconds (a 262k vocabulary): the loop keeps stepping everything else meanwhile.
        self.parked: list[AddRequest] = []
        # Stepped since the heap was last trimmed: the CPU runner keeps a step's freed
        # activations in the heap while serving (runner/heap.py) and hands them back once the
        # engine has had nothing to do for a whole heartbeat.
        self.heap_in_use = False

    def run(self) -> None:
        while self.running:
            idle = self.poisoned is not None or not self.core.has_unfinished()
            handled = self._drain_commands(self.heartbeat_s if idle else 0)
            if idle and not handled and self.heap_in_use:
                self.heap_in_use = False
                release_freed_heap()
            self._unpark()
            if self.running and self.poisoned is None and self.core.has_unfinished():
                self._step()
                self.heap_in_use = True
            if time.monotonic() - self.last_sent >= self.heartbeat_s:
                self._send(Heartbeat())

    def _unpark(self) -> None:
        if self.parked and self.poisoned is None and self.core.structured.ready:
            parked, self.parked = self.parked, []
            for add in parked:
                self._handle(add)

    def _send(self, message: Message) -> None:
        try:
            send(self.conn, message)
        except OSError:  # the HTTP process is gone
            self.running = False
        self.last_sent = time.monotonic()

    def _drain_commands(self, timeout: float) -> int:
        """Handles the commands waiting (the first waited for up to `timeout`); returns how many.
        Consecutive Aborts are carried out together, in one pass over the scheduler's queues:
        a request of many prompts that goes away sends one per prompt."""
        handled = 0
        aborts: list[str] = []
        while self.running and self.conn.poll(timeout):
            try:
                message = decode(self.conn.recv_bytes())
            except (EOFError, OSError):  # the HTTP process is gone
                self.running = False
                break
            except MalformedMessage as exc:
                logger.error("malformed message: %s", exc)
            else:
                if isinstance(message, Abort):
                    aborts.extend(message.request_ids)
                else:
                    self._abort_now(aborts)
                    self._handle(message)
            handled += 1
            timeout = 0
        self._abort_now(aborts)
        return handled

    def _abort_now(self, aborts: list[str]) -> None:
        if aborts:
            self._handle(Abort(list(aborts)))
            aborts.clear()

    def _step(self) -> None:
        try:
            if self.inject_hang:
                _hang()
            if self.inject_fault:
                raise InjectedDeviceFault()
            updates = self.core.step()
        except Exception as exc:  # noqa: BLE001 - classified below
            self._on_step_error(exc)
            return
        if updates:
            self._send(Updates(updates))

    def _on_step_error(self, exc: Exception) -> None:
        """A device fault fails every request and poisons the engine; any other error fails
        only the requests of the step that raised (a waiting request was not part of it)."""
        message = f"{type(exc).__name__}: {exc}"
        device_fault = is_device_fault(exc)
        request_ids = set(self.core.requests)
        if not device_fault and self.core.step_request_ids:
            request_ids &= self.core.step_request_ids
        if device_fault:
            request_ids.update(add.request_id for add in self.parked)
            self.parked = []
        self.core.abort(request_ids)
        self._send(Failed(sorted(request_ids), message))
        if device_fault:
            logger.error("device fault, engine is now drain-only: %s", message)
            self.poisoned = message
            self._send(Poisoned(message))
        else:
            logger.error(
                "step failed (not a device fault): %s\n%s", message, traceback.format_exc()
            )

    # ---- messages and commands ------------------------------------------------------------

    def _handle(self, message: Message) -> None:
        """Carries out one message. Whatever goes wrong, the sender hears of it: a Call gets an
        error Reply, an AddRequest fails its request (an Abort or StopSample has no answer)."""
        try:
            self._dispatch(message)
        except Exception as exc:  # noqa: BLE001 - a bad message fails that message only
            text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            match message:
                case AddRequest():
                    self.core.abort([message.request_id])
                    refused = isinstance(exc, ValueError)
                    self._send(Failed([message.request_id], text, refused))
                case Call():
                    self._send(Reply(message.call_id, False, text))

    def _dispatch(self, message: Message) -> None:
        match message:
            case Call(command="shutdown"):  # a poisoned engine still exits when asked
                self.running = False
                self._send(Reply(message.call_id, True, None))
            case _ if self.poisoned is not None:
                raise RuntimeError(f"model is poisoned: {self.poisoned}")
            case AddRequest():
                self._add(message)
            case Abort():
                self._abort(message.request_ids)
            case StopSample():
                self.core.stop_sample(message.request_id, message.index)
            case Call():
                handler = getattr(self, f"_cmd_{message.command}", None)
                if handler is None:
                    raise ValueError(f"unknown command {message.command!r}")
                self._send(Reply(message.call_id, True, handler(*message.args)))
            case _:
                raise ValueError(f"not a message to the engine: {message!r}")

    def _add(self, add: AddRequest) -> None:
        """Queues a request, or parks it while the grammar backend it needs is first built."""
        if add.params.structured_output is not None and not self.core.structured.ready:
            self.core.structured.start_build()
            self.parked.append(add)
            return
        self.core.add_request(add.request_id, add.prompt_token_ids, add.params, images=add.images)

    def _abort(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        self.parked = [add for add in self.parked if add.request_id not in aborted]
        self.core.abort(request_ids)

    # ---- commands (messages.COMMANDS) -------------------------------------------------------

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

    def _cmd_encode_image(self, pixel_values, grid_thw) -> list[list[float]]:
        """neuron's EncodeImage: the tower's output rows for one preprocessed image."""
        return self.core.encode_image(pixel_values, grid_thw).tolist()

    def _cmd_inject_fault(self) -> None:
        self.inject_fault = True

    def _cmd_inject_hang(self) -> None:
        self.inject_hang = True

    def _cmd_inject_tp_wedge(self) -> None:
        """Tensor parallelism: rank 1 blocks forever in the next step (the step deadline's
        test); a ValueError for a single-rank engine."""
        workers = self.core.runner.workers
        if workers is None:
            raise ValueError("inject_tp_wedge needs a tensor-parallel engine")
        workers.wedge_rank = 1

    def _cmd_inject_step_error(self) -> None:
        """The next forward raises a plain (not device) error, after its step was scheduled."""
        runner = self.core.runner
        forward = runner.forward_logits

        def fail_once(*args, **kwargs):
            runner.forward_logits = forward
            raise ValueError("injected step error")

        runner.forward_logits = fail_once


def _hang() -> None:
    """The fault tests' wedged step: blocks like a kernel or collective that never returns."""
    logger.warning("debug hook: this step never returns")
    while True:
        time.sleep(3600)
