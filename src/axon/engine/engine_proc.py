"""The engine process: neuron's device worker for one model.

It owns everything on the device (weights, KV cache, scheduler) and serves a FIFO of commands
from the HTTP process over a pipe, stepping the engine whenever work is queued. After a device
fault it is drain-only: every command gets a "poisoned" error and the device is not touched
again; the registry then replaces the whole process.

Liveness: the loop sends something at least every `heartbeat_s` (a step's updates, else a
heartbeat), so the HTTP process can tell a wedged step (or a stopped process) from a slow one by
silence alone. The engine dies with the HTTP process: a parent-death signal (Linux) and a watch
on the parent pid, so a killed server leaves no orphan holding device memory.

Messages to the engine:  (kind, call_id, *args)
Messages from it:        ("progress", loaded_bytes, total_bytes) while loading, then
                         ("ready", info) | ("load_failed", message) | ("heartbeat",)
                         ("updates", [wire_update(TokenUpdate)])
                         | ("failed", [request_id], message)
                         ("reply", call_id, ok, payload) | ("poisoned", message)
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import pickle
import signal
import time
import traceback

import torch

from axon.config import EngineConfig
from axon.distributed.workers import die_with_parent
from axon.engine.engine_core import EngineCore
from axon.engine.faults import InjectedDeviceFault, is_device_fault
from axon.loader import progress
from axon.models.weights import parameter_bytes
from axon.outputs import TokenUpdate
from axon.runner.heap import release_freed_heap
from axon.runner.threads import log_thread_policy

logger = logging.getLogger(__name__)

_UPDATE_FIELDS = [field.name for field in dataclasses.fields(TokenUpdate)]
_update_fields = operator.attrgetter(*_UPDATE_FIELDS)
_LOGPROBS = _UPDATE_FIELDS.index("logprobs")


def wire_update(update: TokenUpdate) -> tuple:
    """`update` as it crosses the pipe (read back by EngineClient._dispatch): its fields in
    order, logprobs as a (token_id, logprob, rank, top) tuple. Pickling the dataclass wrote its
    class path and every field name per token; unpickling a TokenLogprobs imported the sampler,
    and torch with it, into the HTTP process's event loop."""
    fields = _update_fields(update)
    lp = update.logprobs
    if lp is None:
        return fields
    plain = (lp.token_id, lp.logprob, lp.rank, lp.top)
    return (*fields[:_LOGPROBS], plain, *fields[_LOGPROBS + 1 :])


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
    progress.set_reporter(lambda loaded, total: conn.send(("progress", loaded, total)))
    try:
        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - every load failure is reported, never raised
        conn.send(("load_failed", f"{type(exc).__name__}: {exc}"))
        return
    _compile_kernels(core)
    if core.runner.workers is not None:
        core.runner.workers.watch(_on_rank_death)
    conn.send(("ready", engine_info(core)))
    try:
        EngineLoop(core, conn, heartbeat_s).run()
    finally:
        core.close()  # the other tensor-parallel ranks exit with the engine


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
        from axon.kernels import build  # lazy: only CPU engines build the C kernels

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
        self.parked: list[tuple] = []
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
                self._send(("heartbeat",))

    def _unpark(self) -> None:
        if self.parked and self.poisoned is None and self.core.structured.ready:
            parked, self.parked = self.parked, []
            for request_id, *request in parked:
                self._handle(("add", None, request_id, *request))

    def _send(self, message: tuple, plain: bool = False) -> None:
        """`plain`: the message holds no tensors or handles, so pickle it plainly. Connection.send
        pickles with a ForkingPickler, which copies every reducer torch registered per call
        (4.4 us against 0.4 us for a step's updates; the receiver reads either)."""
        try:
            if plain:
                self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            else:
                self.conn.send(message)
        except OSError:  # the HTTP process is gone
            self.running = False
        self.last_sent = time.monotonic()

    def _drain_commands(self, timeout: float) -> int:
        """Handles the commands waiting (the first waited for up to `timeout`); returns how many."""
        handled = 0
        while self.running and self.conn.poll(timeout):
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the HTTP process is gone
                self.running = False
                return handled
            self._handle(message)
            handled += 1
            timeout = 0
        return handled

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
            self._send(("updates", [wire_update(update) for update in updates]), plain=True)

    def _on_step_error(self, exc: Exception) -> None:
        """A device fault fails every request and poisons the engine; any other error fails
        only the requests of the step that raised (a waiting request was not part of it)."""
        message = f"{type(exc).__name__}: {exc}"
        device_fault = is_device_fault(exc)
        request_ids = set(self.core.requests)
        if not device_fault and self.core.step_request_ids:
            request_ids &= self.core.step_request_ids
        if device_fault:
            request_ids.update(request_id for request_id, *_ in self.parked)
            self.parked = []
        self.core.abort(request_ids)
        self._send(("failed", sorted(request_ids), message))
        if device_fault:
            logger.error("device fault, engine is now drain-only: %s", message)
            self.poisoned = message
            self._send(("poisoned", message))
        else:
            logger.error(
                "step failed (not a device fault): %s\n%s", message, traceback.format_exc()
            )

    # ---- commands ---------------------------------------------------------------------------

    def _handle(self, message) -> None:
        """Runs one command. Whatever goes wrong, the caller hears of it: a call gets an error
        reply, an `add` fails its request."""
        try:
            kind, call_id, *args = message
        except (TypeError, ValueError):
            logger.error("malformed command %r", message)
            return
        try:
            self._dispatch(kind, call_id, args)
        except Exception as exc:  # noqa: BLE001 - a bad command fails that command only
            text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            if kind == "add" and args:
                self.core.abort([args[0]])
                self._send(("failed", [args[0]], text))
            else:
                self._reply(call_id, False, text)

    def _dispatch(self, kind: str, call_id, args: list) -> None:
        if kind == "shutdown":
            self.running = False
            self._reply(call_id, True, None)
            return
        if self.poisoned is not None:
            raise RuntimeError(f"model is poisoned: {self.poisoned}")
        handler = getattr(self, f"_cmd_{kind}", None)
        if handler is None:
            raise ValueError(f"unknown command {kind!r}")
        result = handler(*args)
        self._reply(call_id, True, result)

    def _reply(self, call_id, ok: bool, payload) -> None:
        if call_id is not None:
            self._send(("reply", call_id, ok, payload))

    def _cmd_add(self, request_id, prompt_token_ids, params, images=None) -> None:
        """Queue a request; `images` (pixel patches and grids, prepared by the HTTP process)
        for a prompt whose image placeholders are expanded."""
        if params.structured_output is not None and not self.core.structured.ready:
            self.core.structured.start_build()
            self.parked.append((request_id, prompt_token_ids, params, images))
            return
        self.core.add_request(request_id, prompt_token_ids, params, images=images)

    def _cmd_abort(self, request_ids) -> None:
        aborted = set(request_ids)
        self.parked = [entry for entry in self.parked if entry[0] not in aborted]
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
