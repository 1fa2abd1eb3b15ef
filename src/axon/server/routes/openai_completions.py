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
from axon.server.admission import check_request
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
from axon.server.offload import json_response, maybe_off_loop, off_loop
from axon.server.reasoning_budget import completion_thinking_fields
from axon.server.sampling import build_sampling_params, check_prompt_ids
from axon.server.schemas.logprobs import echo_logprobs, prompt_logprobs_json
from axon.server.schemas.protocol import (
    CompletionRequest,
    SampleCursor,
    completion_logprobs,
    draft_totals,
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


_CHUNK_PROMPTS = 32  # prompts tokenized per turn on the request pool


def _prompt_items(body: CompletionRequest) -> list:
    """The prompts the request carries, as sent (texts or token-id lists)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    return prompt


def _tokenize(body: CompletionRequest, model, items: list) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each of `items`."""
    vocab = vocab_size(model)
    prompts = []
    for item in items:
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
    if body.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    model = await request_model(request, body.model)
    items = _prompt_items(body)
    check_request(model, body, len(items))
    prompts, params = await _prepare(body, model, items)
    generations = await or_disconnect(request, start_all(model, prompts, params, started_at))
    context = _CompletionContext(body, model, params)
    if body.stream:
        return EventStream(_completion_stream(generations, context), close_all(generations))
    states = await or_disconnect(request, asyncio.gather(*(g.collect() for g in generations)))
    return await json_response(context.response, states)


async def _prepare(body: CompletionRequest, model, items: list) -> tuple[list, object]:
    """The prompts' (text, token ids) and the sampling params, off the loop: a chunk of prompts
    at a time, so a long list holds a thread of the request pool for a chunk's time, not the
    whole list's, and a prompt that does not fit stops it early."""
    prompts = []
    while len(items) > _CHUNK_PROMPTS:
        prompts += await off_loop(_tokenize, body, model, items[:_CHUNK_PROMPTS])
        items = items[_CHUNK_PROMPTS:]
    return await off_loop(_finish_prepare, body, model, prompts, items)


def _finish_prepare(body: CompletionRequest, model, prompts: list, items: list):
    prompts += _tokenize(body, model, items)
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

    def body_of(self, choices, **extra) -> dict:
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
        drafts = draft_totals([sample for state in states for sample in state.samples])
        return usage(prompt_tokens, 0 if self.body.echo_only else generated, cached, drafts)

    def response(self, states: list[RequestState]) -> dict:
        """The whole answer; its choices a generator (see _ChatContext.response)."""
        return self.body_of(self._choices(states), usage=self.usage(states))

    def _choices(self, states: list[RequestState]):
        for prompt_index, state in enumerate(states):
            for sample in state.samples:
                choice = self.choice(prompt_index, sample, *self._whole(state, sample), True)
                if self.body.echo_only:
                    choice["finish_reason"], choice["stop_reason"] = "length", None
                if state.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(state.prompt_logprobs)
                yield choice

    def _whole(self, state: RequestState, sample) -> tuple[str, dict | None]:
        """A finished sample's text and logprobs, after the prompt's with `echo` (the prompt
        alone with `max_tokens: 0`: the one token the engine sampled is left out)."""
        kept = range(0 if self.body.echo_only else len(sample.token_ids))
        text = sample.text if kept else ""
        if not self.body.echo:
            return text, self.logprobs(sample, kept, 0)
        return self.after_prompt(state, sample, text, kept)

    def after_prompt(self, state: RequestState, sample, text: str, positions: range):
        """`echo`: the prompt's text, then `text`; the prompt's logprobs (its first token's
        null), then those of the sample's tokens at `positions`, when logprobs are asked."""
        prompt_ids = state.prompt_token_ids
        prompt = state.prompt
        if prompt is None:  # token ids: their text
            prompt = self.model.tokenizer.decode(prompt_ids) if self.model.tokenizer else ""
        if self.params.logprobs is None:
            return prompt + text, None
        echoed = echo_logprobs(prompt_ids, state.prompt_logprobs, self.params.logprobs, self.decode)
        offset = sum(len(token) for token in echoed["tokens"])
        generated = self.logprobs(sample, positions, offset)
        for key, values in (generated or {}).items():
            echoed[key].extend(values)
        return prompt + text, echoed

    def streamed(
        self, prompt_index: int, state: RequestState, sample, cursor: SampleCursor
    ) -> dict | None:
        """The next streamed choice of a sample (None when nothing is new); with `echo` the
        first one carries the prompt before the first token, as vLLM streams it (the prompt
        alone with `max_tokens: 0`)."""
        first, offset = cursor.num_tokens == 0, cursor.text_offset
        step = cursor.advance(sample)
        if step is None:
            return None
        text, positions = step
        if self.body.echo_only:
            positions, text = range(0), ""
        if self.body.echo and first:
            text, logprobs = self.after_prompt(state, sample, text, positions)
        else:
            logprobs = self.logprobs(sample, positions, offset)
        if logprobs is not None:
            cursor.text_offset = offset + sum(len(t) for t in logprobs["tokens"])
        if self.body.echo_only:
            cursor.done = True
        choice = self.choice(prompt_index, sample, text, logprobs, cursor.done)
        if self.body.echo_only:
            choice["finish_reason"], choice["stop_reason"] = "length", None
        return choice


def _step_chunks(context: _CompletionContext, prompt_index: int, state, cursors) -> str:
    """Every chunk one engine step of one prompt makes, across its samples, as one write."""
    chunks = []
    for sample, cursor in zip(state.samples, cursors):
        choice = context.streamed(prompt_index, state, sample, cursor)
        if choice is not None:
            chunks.append(context.chunk(choice))
    return "".join(chunks)


async def _completion_stream(generations: list[Generation], context: _CompletionContext):
    cursors = [[SampleCursor() for _ in range(context.params.n)] for _ in generations]
    wide = context.params.n > 1 or context.params.logprobs is not None or context.body.echo
    states: dict[int, RequestState] = {}
    try:
        async with contextlib.aclosing(merge(generations)) as progress:
            async for prompt_index, state in progress:
                states[prompt_index] = state
                step = (context, prompt_index, state, cursors[prompt_index])
                chunks = await maybe_off_loop(wide, _step_chunks, *step)
                if chunks:
                    yield chunks
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        yield error_event(exc)
    else:
        if context.body.include_usage:
            yield sse(context.body_of([], usage=context.usage(list(states.values()))))
    yield sse("[DONE]")
