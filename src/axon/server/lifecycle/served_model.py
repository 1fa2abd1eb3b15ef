"""One loaded model as the HTTP process sees it: its engine process, tokenizer, chat template,
admission control, and the per-request output processing (detokenization, stop strings)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from axon.config import EngineConfig
from axon.engine.client import EngineClient, EngineError, EngineRefused, Liveness
from axon.engine.output_processor import RequestState
from axon.sampling_params import SamplingParams
from axon.server.admission import RequestCaps
from axon.server.errors import (
    BadRequest,
    ContextLengthExceeded,
    EngineDead,
    ModelUnavailable,
    Overloaded,
    Unprocessable,
)
from axon.server.images import ImageFrontend, media_policy
from axon.server.lifecycle.debug_hooks import fire_debug_hooks
from axon.server.lifecycle.frontend import load_frontend, load_generation_defaults
from axon.tokenizer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateRefused,
    render_chat,
)

logger = logging.getLogger(__name__)

_PROBE_CHARS_PER_TOKEN = 16  # a long text's head that is tokenized first (see encode)
_PROBE_SLACK_TOKENS = 8


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _liveness(server_config) -> Liveness:
    if server_config is None:
        return Liveness()
    return Liveness(server_config.engine_step_timeout_s, server_config.engine_load_timeout_s)


def _device_env(spec) -> dict[str, str]:
    """The engine's environment: `devices` pins it to those GPUs (it sees them as 0..N-1)."""
    devices = getattr(spec, "devices", None)
    if not devices:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(device) for device in devices)}


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
        images: ImageFrontend | None = None,
    ):
        self.id = model_id
        self.spec = spec
        self.client = client
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.chat_template = chat_template  # None: the renderer's ChatML fallback
        self.max_model_len: int = client.info["max_model_len"]
        self.parameter_bytes: dict | None = client.info.get("parameter_bytes")  # total, active
        self.activation_precision: str | None = client.info.get("activation_precision")
        self.generation_defaults = load_generation_defaults(model_path)
        self.created = int(time.time())
        self.images = images  # None: no vision tower, image parts are a 400
        self.task: str = client.info.get("task", "generate")  # "embed": /v1/embeddings only
        self.capabilities = ["text", "vision"] if images is not None else ["text"]
        if self.task == "embed":
            self.capabilities = ["embeddings"]
        self.devices = list(getattr(spec, "devices", None) or [])
        self.max_num_seqs = client.config.max_num_seqs
        self.max_waiting_requests = getattr(server_config, "max_waiting_requests", 256)
        self.max_waiting_tokens = getattr(server_config, "max_waiting_tokens", 1 << 20)
        self.size_caps = RequestCaps.of(self, server_config)  # after max_num_seqs and task
        self.num_inflight = 0  # requests
        self.num_inflight_seqs = 0  # their sequences (n each)
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
        chat_template: ChatTemplate | None = None,
        previous: ServedModel | None = None,
        on_progress=None,
        spawned=None,
    ) -> ServedModel:
        """Spawn the engine process for `model_path` and wait until it is ready; the tokenizer
        loads meanwhile, in a thread. `chat_template` is the text of a template that overrides
        the model's own (the registry reads the spec's file, under its path rules, before the
        load; this never reads a path from the spec). `previous`: the faulted model this one
        replaces, whose tokenizer and template are reused (a recovery loads only weights).
        `on_progress(loaded, total)`: the bytes of weights loaded so far, as the engine loads.
        `spawned`: an engine spawned ahead for this model (see EngineClient.start)."""
        config = EngineConfig.from_kwargs(str(model_path), **engine_args)
        if previous is not None:
            frontend = asyncio.get_running_loop().create_future()
            frontend.set_result((previous.tokenizer, previous.chat_template))
        else:
            frontend = asyncio.ensure_future(
                asyncio.to_thread(load_frontend, model_id, config, chat_template)
            )
        frontend.add_done_callback(_retrieve)  # a failed engine start leaves it unawaited
        client = await EngineClient.start(
            config,
            liveness=_liveness(server_config),
            env=_device_env(spec),
            on_progress=on_progress,
            spawned=spawned,
        )
        try:
            tokenizer, template = await frontend
            vision = client.info.get("vision")
            policy = media_policy(server_config)
            images = await asyncio.to_thread(ImageFrontend.of, str(model_path), vision, policy)
        except BaseException:
            await client.shutdown()
            raise
        return cls(
            model_id, spec, client, tokenizer, str(model_path), server_config, template, images
        )

    # ---- status -----------------------------------------------------------------------------

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (its process group holds every rank)."""
        return self.client.process.pid

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

    @property
    def responsive(self) -> bool:
        """Whether its engine was heard from lately (a stopped one is not, until the deadline)."""
        return self.client.responsive

    # ---- prompts ----------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict],
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for `messages` (the final message left open with
        `continue_final_message`); raises BadRequest when the template refuses the
        conversation's shape (its own raise_exception), else Unprocessable when it fails."""
        try:
            return render_chat(
                self.tokenizer,
                messages,
                tools,
                chat_template_kwargs,
                add_generation_prompt,
                chat_template=self.chat_template,
                continue_final_message=continue_final_message,
            )
        except ChatTemplateRefused as exc:
            raise BadRequest(exc.message, code=exc.code, param="messages") from exc
        except ChatTemplateError as exc:
            raise Unprocessable(exc.message, code=exc.code) from exc

    def encode(
        self, text: str, add_special_tokens: bool = True, param: str | None = None
    ) -> list[int]:
        """The token ids of `text`. With `param` (the request field it came from), a text far
        longer than the context is refused from its head alone: a 10 MB prompt costs the
        tokenization of a few hundred KB, not of all of it. Raises ContextLengthExceeded."""
        if self.tokenizer is None:
            raise ModelUnavailable(f"model {self.id!r} has no tokenizer; send token ids")
        limit = self.max_model_len
        probe = limit * _PROBE_CHARS_PER_TOKEN
        if param is not None and len(text) > probe:
            head = self.tokenizer.encode(text[:probe], add_special_tokens=add_special_tokens)
            # The whole text has at least the head's tokens, give or take the few at the cut.
            if len(head) > limit + _PROBE_SLACK_TOKENS:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt has more than {len(head) - _PROBE_SLACK_TOKENS} tokens; reduce the "
                    f"length of the {param}.",
                    param=param,
                )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- generation -------------------------------------------------------------------------

    def check_capacity(self, num_seqs: int, num_prompt_tokens: int) -> None:
        """Raises Overloaded (429, Retry-After) unless a request of `num_seqs` sequences (`n`
        for each of its prompts) and `num_prompt_tokens` fits the waiting queue. Sequences,
        not requests: one request with n=128 is 128 sequences of work. An idle model takes any
        single request whose prompts fit its context."""
        waiting = self.num_inflight_seqs + num_seqs - self.max_num_seqs
        too_many = waiting > self.max_waiting_requests
        too_long = self.num_waiting_tokens + num_prompt_tokens > self.max_waiting_tokens
        if self.num_inflight and (too_many or too_long):
            raise Overloaded(
                f"model {self.id!r} has {self.num_inflight_seqs} sequences in flight; "
                "retry shortly",
                headers={"Retry-After": "1"},
            )

    def _check_available(self) -> None:
        if not self.accepting:
            raise ModelUnavailable(
                f"model {self.id!r} is shutting down", headers={"Retry-After": "5"}
            )
        if self.status != "loaded":
            raise ModelUnavailable(
                f"model {self.id!r} is {self.status}", headers={"Retry-After": "5"}
            )

    def _admit(self, prompt_len: int, params: SamplingParams, capacity_checked: bool) -> None:
        if self.task == "embed":
            raise BadRequest(
                f"model {self.id!r} is an embedding model (task embed): it generates no text; "
                "use /v1/embeddings",
                param="model",
            )
        self._check_available()
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
        if not capacity_checked:
            self.size_caps.check_params([prompt_len], params)
            self.check_capacity(params.n, prompt_len)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        capacity_checked: bool = False,
        images: dict | None = None,
    ) -> AsyncIterator[RequestState]:
        """Yield the request's state: once as soon as it is admitted (no output yet), then each
        time it changes, the last time finished. Raises admission errors before the first
        yield; leaving early aborts it in the engine. `images`: the engine's image inputs
        (server/images.py) for a prompt whose placeholders are expanded."""
        self._admit(len(prompt_token_ids), params, capacity_checked)
        request_id = uuid.uuid4().hex
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        await fire_debug_hooks(self.id, self.client)
        self._enter(len(prompt_token_ids), params.n)
        waiting_tokens = len(prompt_token_ids)
        stream = self.client.generate(request_id, prompt_token_ids, params, images)
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
        except EngineRefused as exc:
            raise BadRequest(f"model {self.id!r} cannot serve this request: {exc}") from exc
        except EngineError as exc:
            raise EngineDead(f"model {self.id!r} failed: {exc}") from exc
        finally:
            await stream.aclose()
            self.num_waiting_tokens -= waiting_tokens
            self._leave(params.n)

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """The pooled vector of each prompt (token ids), all submitted at once so the engine
        batches them. Raises BadRequest (a generate-task model), ContextLengthExceeded,
        Overloaded or ModelUnavailable before submitting anything, EngineDead after."""
        if self.task != "embed":
            raise BadRequest(
                f"model {self.id!r} generates text (task generate): it serves no embeddings; "
                "serve an embedding model, or this one with --task embed",
                param="model",
            )
        self._check_available()
        for ids in prompts:
            if len(ids) > self.max_model_len:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your input has {len(ids)} tokens; reduce the length of the input.",
                    param="input",
                )
        self.size_caps.check_sequences(len(prompts), prompts_param="input")
        self.check_capacity(len(prompts), sum(len(ids) for ids in prompts))
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels (aborts) the rest
                tasks = [group.create_task(self._embed_one(ids)) for ids in prompts]
        except ExceptionGroup as failures:
            raise failures.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _embed_one(self, prompt_token_ids: list[int]) -> list[float]:
        self._enter(len(prompt_token_ids), 1)
        params = SamplingParams(max_tokens=1)  # prefill only: nothing is sampled
        stream = self.client.generate(uuid.uuid4().hex, prompt_token_ids, params)
        try:
            async for update in stream:
                if update.embedding is not None:
                    return update.embedding
            raise EngineDead(f"model {self.id!r} ended an embedding request without a vector")
        except EngineError as exc:
            raise EngineDead(f"model {self.id!r} failed: {exc}") from exc
        finally:
            await stream.aclose()
            self.num_waiting_tokens -= len(prompt_token_ids)
            self._leave(1)

    def _enter(self, prompt_len: int, num_seqs: int) -> None:
        self.num_inflight += 1
        self.num_inflight_seqs += num_seqs
        self.num_waiting_tokens += prompt_len
        self._idle.clear()

    def _leave(self, num_seqs: int) -> None:
        self.num_inflight -= 1
        self.num_inflight_seqs -= num_seqs
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
