"""`POST /v1/chat/completions`: the chat template renders the messages, the engine generates, and
the answer goes back whole or as SSE chunks (role, one per token, finish, usage, `[DONE]`).
The prompt, images, output plan and sampling params: chat_pipeline.py; reasoning, tool calls and
structured output: chat_output.py."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from axon.engine.output_processor import RequestState
from axon.server.admission import check_request
from axon.server.chat_output import ChatOutputPlan, ChoiceOutput
from axon.server.chat_pipeline import prepare_chat
from axon.server.generation import EventStream, Generation, or_disconnect, request_model
from axon.server.offload import json_response, maybe_off_loop, off_loop
from axon.server.schemas.logprobs import prompt_logprobs_json
from axon.server.schemas.protocol import (
    ChatCompletionRequest,
    SampleCursor,
    chat_logprobs,
    draft_totals,
    error_event,
    now,
    parse_request,
    random_id,
    sse,
    usage,
)

router = APIRouter()


class _ChatContext:
    """One chat request's constants and the builders of its choices and chunks."""

    def __init__(self, body: ChatCompletionRequest, model, params, plan: ChatOutputPlan):
        self.body, self.model, self.params, self.plan = body, model, params, plan
        self.id, self.created = random_id("chatcmpl-"), now()

    def decode(self, token_id: int) -> str:
        tokenizer = self.model.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def logprobs(self, sample, positions: range) -> dict | None:
        if self.params.logprobs is None or sample.logprobs is None or not positions:
            return None
        ids = sample.token_ids[positions.start : positions.stop]
        entries = sample.logprobs[positions.start : positions.stop]
        return chat_logprobs(ids, entries, self.params.logprobs, self.decode)

    def chunk(self, index: int, delta: dict, logprobs=None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(self._envelope("chat.completion.chunk", [choice]))

    def _envelope(self, kind: str, choices, **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.body.model,  # the name the client sent: an alias stays one
            "choices": choices,
            **extra,
        }

    def usage(self, state: RequestState) -> dict:
        generated = sum(len(sample.token_ids) for sample in state.samples)
        cached = state.samples[0].num_cached_tokens
        drafts = draft_totals(state.samples)
        return usage(len(state.prompt_token_ids), generated, cached, drafts)

    def usage_chunk(self, state: RequestState) -> str:
        return sse(self._envelope("chat.completion.chunk", [], usage=self.usage(state)))

    def response(self, state: RequestState) -> dict:
        """The whole answer; its choices a generator, each built as offload.encode_json reaches
        it and dropped once encoded, so that a big answer is never all in memory as objects
        (whose number would make each of the GC's full passes, which stall the loop, long)."""
        choices = (self._choice(sample) for sample in state.samples)
        extra = {"usage": self.usage(state)}
        if state.prompt_logprobs is not None:  # vLLM's, when asked
            extra["prompt_logprobs"] = prompt_logprobs_json(state.prompt_logprobs)
        return self._envelope("chat.completion", choices, **extra)

    def _choice(self, sample) -> dict:
        output = ChoiceOutput(self.plan)
        return {
            "index": sample.index,
            "message": output.message(sample.text, sample.finish_reason),
            "logprobs": self.logprobs(sample, range(len(sample.token_ids))),
            "finish_reason": output.finish_reason(sample.finish_reason),
            "stop_reason": sample.stop_reason,
        }


def _sample_chunks(context: _ChatContext, sample, cursor: SampleCursor, output: ChoiceOutput):
    """The chunks one sample's progress since the last state makes: its deltas (content,
    reasoning, tool calls; the step's logprobs on the first), then its end."""
    step = cursor.advance(sample)
    if step is None:
        return
    text, positions = step
    logprobs = context.logprobs(sample, positions)
    deltas = output.deltas(text, cursor.done, sample.finish_reason if cursor.done else None)
    if logprobs and not deltas:
        deltas = [{"content": ""}]
    for number, delta in enumerate(deltas):
        yield context.chunk(sample.index, delta, logprobs if number == 0 else None)
    if cursor.done:
        reason = output.finish_reason(sample.finish_reason)
        yield context.chunk(sample.index, {}, finish=reason)


def _step_chunks(context: _ChatContext, state: RequestState, cursors, outputs) -> str:
    """Every chunk one engine step makes, across the request's samples, as one write."""
    return "".join(
        chunk
        for sample, cursor, output in zip(state.samples, cursors, outputs)
        for chunk in _sample_chunks(context, sample, cursor, output)
    )


async def _chat_stream(generation: Generation, context: _ChatContext):
    cursors = [SampleCursor() for _ in range(context.params.n)]
    outputs = [ChoiceOutput(context.plan) for _ in range(context.params.n)]
    wide = context.params.n > 1 or context.params.logprobs is not None
    state = generation.state
    try:
        for index in range(context.params.n):
            yield context.chunk(index, {"role": "assistant", "content": ""})
        async for state in generation:
            chunks = await maybe_off_loop(wide, _step_chunks, context, state, cursors, outputs)
            if chunks:
                yield chunks
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        yield error_event(exc)
    else:
        if context.body.include_usage:
            yield context.usage_chunk(state)
    finally:
        await generation.aclose()
    yield sse("[DONE]")


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), ChatCompletionRequest)
    model = await request_model(request, body.model)
    check_request(model, body)
    prepared = await off_loop(prepare_chat, model, body, request.headers)
    generation = await or_disconnect(request, Generation.of_chat(model, prepared, started_at))
    context = _ChatContext(body, model, prepared.params, prepared.plan)
    if body.stream:
        return EventStream(_chat_stream(generation, context), generation.aclose)
    state = await or_disconnect(request, generation.collect())
    return await json_response(context.response, state)
