"""One loaded model as the HTTP process sees it: its engine process, tokenizer, chat template,
admission control, and the per-request output processing (detokenization, stop strings)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from axon.config import EngineConfig
from axon.engine.client import EngineClient, EngineError
from axon.engine.llm import load_tokenizer
from axon.engine.output_processor import RequestState
from axon.sampling_params import SamplingParams
from axon.server.errors import ContextLengthExceeded, EngineDead, ModelUnavailable, Overloaded
from axon.tokenizer.chat_template import (
    ChatTemplate,
    load_template_file,
    render_chat,
    resolve_chat_template,
    warn_chatml_fallback,
)

logger = logging.getLogger(__name__)

_DEBUG_POISONED: set[str] = set()
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path: str) -> dict:
    """Sampling defaults from generation_config.json (only the keys it sets)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {k: data[k] for k in _GENERATION_DEFAULT_KEYS if data.get(k) is not None}


def _model_template(model_id: str, tokenizer_path: str, tokenizer, override) -> ChatTemplate | None:
    """The model's chat template (see resolve_chat_template), also set on the tokenizer so that
    whatever reads `tokenizer.chat_template` (the output parsers) sees the one in use."""
    if tokenizer is None:
        return None
    template = resolve_chat_template(tokenizer_path, tokenizer, override)
    if template is None:
        warn_chatml_fallback(tokenizer, model_id)
    else:
        tokenizer.chat_template = template
    return template


class ServedModel:
    def __init__(
        self,
        model_id: str,
        spec,
        client: EngineClient,
        tokenizer,
        model_path: str,
        server_config=None,
        chat_template: ChatTemplate | None = None,
    ):
        self.id = model_id
        self.spec = spec
        self.client = client
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.chat_template = chat_template  # None: the renderer's ChatML fallback
        self.max_model_len: int = client.info["max_model_len"]
        self.generation_defaults = load_generation_defaults(model_path)
        self.created = int(time.time())
        self.capabilities = ["text"]
        self.devices = list(getattr(spec, "devices", None) or [])
        self.max_num_seqs = client.config.max_num_seqs
        self.max_waiting_requests = getattr(server_config, "max_waiting_requests", 256)
        self.max_waiting_tokens = getattr(server_config, "max_waiting_tokens", 1 << 20)
        self.num_inflight = 0
        self.num_waiting_tokens = 0  # prompt tokens of requests still waiting for a first token
        self.accepting = True
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    async def start(
        cls,
        model_id: str,
        model_path: str,
        engine_args: dict,
        spec=None,
        server_config=None,
        chat_template: str | None = None,
    ) -> ServedModel:
        """Spawn the engine process for `model_path` and wait until it is ready. `chat_template`
        (default: the spec's) is a template file that overrides the model's own."""
        override = chat_template or getattr(spec, "chat_template", None)
        if override is not None:
            load_template_file(override)  # a bad file fails the load before the engine starts
        config = EngineConfig.from_kwargs(str(model_path), **engine_args)
        client = await EngineClient.start(config)
        try:
            tokenizer_path = config.tokenizer or config.model
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
            template = _model_template(model_id, tokenizer_path, tokenizer, override)
        except Exception:
            await client.shutdown()
            raise
        return cls(model_id, spec, client, tokenizer, str(model_path), server_config, template)

    # ---- status -----------------------------------------------------------------------------

    @property
    def status(self) -> str:
        return "poisoned" if self.client.poisoned is not None or self.client.dead else "loaded"

    @property
    def on_poisoned(self):
        return self.client.on_poisoned

    @on_poisoned.setter
    def on_poisoned(self, callback) -> None:
        self.client.on_poisoned = callback

    async def memory(self) -> dict:
        free, total = await self.client.call("memory")
        return {"used_bytes": total - free, "free_bytes": free, "total_bytes": total}

    async def stats(self) -> dict:
        return await self.client.call("stats")

    # ---- prompts ----------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict],
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for `messages`; raises Unprocessable(template_render_failed)."""
        return render_chat(
            self.tokenizer,
            messages,
            tools,
            chat_template_kwargs,
            add_generation_prompt,
            chat_template=self.chat_template,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ModelUnavailable(f"model {self.id!r} has no tokenizer; send token ids")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- generation -------------------------------------------------------------------------

    def _admit(self, prompt_len: int, params: SamplingParams) -> None:
        if not self.accepting:
            raise ModelUnavailable(
                f"model {self.id!r} is shutting down", headers={"Retry-After": "5"}
            )
        if self.status != "loaded":
            raise ModelUnavailable(
                f"model {self.id!r} is {self.status}", headers={"Retry-After": "5"}
            )
        limit = self.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max(1, limit - prompt_len)
        if prompt_len >= limit or prompt_len + params.max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens} in the completion).",
                param="max_tokens" if prompt_len < limit else "messages",
            )
        waiting = self.num_inflight - self.max_num_seqs
        if waiting >= self.max_waiting_requests or (
            self.num_waiting_tokens + prompt_len > self.max_waiting_tokens and self.num_inflight
        ):
            raise Overloaded(
                f"model {self.id!r} has {self.num_inflight} requests in flight; retry shortly",
                headers={"Retry-After": "1"},
            )

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> AsyncIterator[RequestState]:
        """Yield the request's state: once as soon as it is admitted (no output yet), then each
        time it changes, the last time finished. Raises admission errors before the first
        yield; leaving early aborts it in the engine."""
        self._admit(len(prompt_token_ids), params)
        request_id = uuid.uuid4().hex
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        if os.environ.get("AXON_DEBUG_POISON") == self.id and self.id not in _DEBUG_POISONED:
            # neuron's NEURON_DEBUG_POISON: the named model's first request in this process
            # injects a device fault, so tests can drive poisoning and recovery end to end.
            _DEBUG_POISONED.add(self.id)
            await self.client.call("inject_fault")
        self._enter(len(prompt_token_ids))
        waiting_tokens = len(prompt_token_ids)
        stream = self.client.generate(request_id, prompt_token_ids, params)
        try:
            yield state
            async for update in stream:
                if waiting_tokens and update.token_id is not None:
                    self.num_waiting_tokens -= waiting_tokens
                    waiting_tokens = 0
                if state.samples[update.index].add(update) and params.n > 1:
                    self.client.stop_sample(request_id, update.index)
                yield state
                if state.finished:
                    break
        except EngineError as exc:
            raise EngineDead(f"model {self.id!r} failed: {exc}") from exc
        finally:
            await stream.aclose()
            self.num_waiting_tokens -= waiting_tokens
            self._leave()

    def _enter(self, prompt_len: int) -> None:
        self.num_inflight += 1
        self.num_waiting_tokens += prompt_len
        self._idle.clear()

    def _leave(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0:
            self._idle.set()

    def kill(self) -> None:
        """SIGKILL the engine process group (recovery of a faulted engine)."""
        self.client.kill()

    async def shutdown(self, grace_s: float = 20.0) -> None:
        """Stop admitting, give in-flight requests up to `grace_s`, then stop the engine."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            logger.warning(
                "%s: %d requests still running after %.0fs; failing them",
                self.id,
                self.num_inflight,
                grace_s,
            )
        await self.client.shutdown()
