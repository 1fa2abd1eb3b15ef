"""`POST /v1/completions`: one or several prompts (text or token ids), answered whole or as SSE
chunks; the admission, disconnect and streaming machinery is generation.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import APIRouter, Request

from axon.engine.output_processor import RequestState
from axon.server.errors import BadRequest
from axon.server.generation import (
    EventStream,
    Generation,
    close_all,
    merge,
    or_disconnect,
    request_model,
    start_all,
    vocab_size,
)
from axon.server.offload import off_loop
from axon.server.reasoning_budget import completion_thinking_fields
from axon.server.sampling import build_sampling_params, check_prompt_ids
from axon.server.schemas.logprobs import echo_logprobs, prompt_logprobs_json
from axon.server.schemas.protocol import (
    CompletionRequest,
    SampleCursor,
    completion_logprobs,
    error_event,
    finish_reason,
    now,
    parse_request,
    random_id,
    sse,
    usage,
)

logger = logging.getLogger(__name__)
router = APIRouter()


# ---- /v1/completions ----------------------------------------------------------------------


def _prompts(body: CompletionRequest, model) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt the request carries."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    vocab = vocab_size(model)
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            ids = model.encode(item, add_special_tokens=body.add_special_tokens, param="prompt")
            prompts.append((item, check_prompt_ids(ids, "prompt")))
            continue
        if not item or any(t < 0 or (vocab and t >= vocab) for t in item):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        prompts.append((None, list(item)))
    return prompts


@router.post("/v1/completions")
async def create_completion(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), CompletionRequest)
    if body.echo and body.stream:
        raise BadRequest("echo is not supported with stream: true", param="echo")
    if body.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    model = await request_model(request, body.model)
    prompts, params = await off_loop(_prepare, body, model)
    generations = await or_disconnect(request, start_all(model, prompts, params, started_at))
    context = _CompletionContext(body, model, params)
    if body.stream:
        return EventStream(_completion_stream(generations, context), close_all(generations))
    states = await or_disconnect(request, asyncio.gather(*(g.collect() for g in generations)))
    return await off_loop(context.response, states)


def _prepare(body: CompletionRequest, model) -> tuple[list, object]:
    """The prompts' (text, token ids) and the sampling params: request-sized, off the loop."""
    prompts = _prompts(body, model)
    longest = max(len(ids) for _, ids in prompts)
    params = build_sampling_params(
        body,
        longest,
        model.max_model_len,
        model.generation_defaults,
        prompt_field="prompt",
        vocab_size=vocab_size(model),
        thinking=completion_thinking_fields(model, body.thinking_token_budget, prompts),
    )
    return prompts, params


class _CompletionContext:
    """One completions request's constants and the builders of its choices."""

    def __init__(self, body: CompletionRequest, model, params):
        self.body, self.model, self.params = body, model, params
        self.id, self.created = random_id("cmpl-"), now()
        self._chunk_head: str | None = None  # a chunk's serialized start, up to its choice

    def decode(self, token_id: int) -> str:
        tokenizer = self.model.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def logprobs(self, sample, positions: range, text_offset: int) -> dict | None:
        if self.params.logprobs is None or sample.logprobs is None or not positions:
            return None
        ids = sample.token_ids[positions.start : positions.stop]
        entries = sample.logprobs[positions.start : positions.stop]
        return completion_logprobs(ids, entries, self.params.logprobs, self.decode, text_offset)

    def choice(self, prompt_index: int, sample, text: str, logprobs, finished: bool) -> dict:
        return {
            "index": prompt_index * self.params.n + sample.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(sample.finish_reason) if finished else None,
            "stop_reason": sample.stop_reason if finished else None,
        }

    def chunk(self, choice: dict) -> str:
        """Return the SSE event of one streamed choice: `sse(self.body_of([choice]))`, with the
        request's constant fields serialized once and only the text encoded for a plain token
        (no logprobs, not the last), which is most of them."""
        if choice["logprobs"] is not None or choice["finish_reason"] is not None:
            return sse(self.body_of([choice]))
        if self._chunk_head is None:
            head = sse(self.body_of([]))  # 'data: {..."choices":[]}\n\n'
            self._chunk_head = head[: -len("]}\n\n")]
        text = json.dumps(choice["text"], ensure_ascii=False)
        return (
            f'{self._chunk_head}{{"index":{choice["index"]},"text":{text},'
            '"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        )

    def body_of(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.body.model,  # the name the client sent: an alias stays one
            "choices": choices,
            **extra,
        }

    def usage(self, states: list[RequestState]) -> dict:
        prompt_tokens = sum(len(state.prompt_token_ids) for state in states)
        generated = sum(len(s.token_ids) for state in states for s in state.samples)
        cached = sum(state.samples[0].num_cached_tokens for state in states)
        return usage(prompt_tokens, 0 if self.body.echo_only else generated, cached)

    def response(self, states: list[RequestState]) -> dict:
        choices = []
        for prompt_index, state in enumerate(states):
            for sample in state.samples:
                choice = self.choice(prompt_index, sample, *self._whole(state, sample), True)
                if self.body.echo_only:
                    choice["finish_reason"], choice["stop_reason"] = "length", None
                if state.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(state.prompt_logprobs)
                choices.append(choice)
        return self.body_of(choices, usage=self.usage(states))

    def _whole(self, state: RequestState, sample) -> tuple[str, dict | None]:
        """A finished sample's text and logprobs, after the prompt's with `echo` (the prompt
        alone with `max_tokens: 0`: the one token the engine sampled is left out)."""
        kept = range(0 if self.body.echo_only else len(sample.token_ids))
        text = sample.text if kept else ""
        if not self.body.echo:
            return text, self.logprobs(sample, kept, 0)
        prompt_ids = state.prompt_token_ids
        prompt = state.prompt
        if prompt is None:  # token ids: their text
            prompt = self.model.tokenizer.decode(prompt_ids) if self.model.tokenizer else ""
        if self.params.logprobs is None:
            return prompt + text, None
        echoed = echo_logprobs(prompt_ids, state.prompt_logprobs, self.params.logprobs, self.decode)
        offset = sum(len(token) for token in echoed["tokens"])
        generated = self.logprobs(sample, kept, offset)
        for key, values in (generated or {}).items():
            echoed[key].extend(values)
        return prompt + text, echoed


async def _completion_stream(generations: list[Generation], context: _CompletionContext):
    cursors = [[SampleCursor() for _ in range(context.params.n)] for _ in generations]
    states: dict[int, RequestState] = {}
    try:
        async with contextlib.aclosing(merge(generations)) as progress:
            async for prompt_index, state in progress:
                states[prompt_index] = state
                for sample, cursor in zip(state.samples, cursors[prompt_index]):
                    offset = cursor.text_offset
                    step = cursor.advance(sample)
                    if step is None:
                        continue
                    text, positions = step
                    logprobs = context.logprobs(sample, positions, offset)
                    if logprobs is not None:
                        cursor.text_offset += sum(len(t) for t in logprobs["tokens"])
                    choice = context.choice(prompt_index, sample, text, logprobs, cursor.done)
                    yield context.chunk(choice)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        yield error_event(exc)
    else:
        if context.body.include_usage:
            yield sse(context.body_of([], usage=context.usage(list(states.values()))))
    yield sse("[DONE]")
