"""`POST /v1/chat/completions`: the chat template renders the messages, the engine generates, and
the answer goes back whole or as SSE chunks (role, one per token, finish, usage, `[DONE]`).
The prompt, images, output plan and sampling params: chat_pipeline.py; reasoning, tool calls and
structured output: chat_output.py."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from axon.engine.output_processor import RequestState
from axon.server.chat_output import ChatOutputPlan, ChoiceOutput
from axon.server.chat_pipeline import prepare_chat
from axon.server.generation import EventStream, Generation, or_disconnect, request_model
from axon.server.offload import off_loop
from axon.server.schemas.logprobs import prompt_logprobs_json
from axon.server.schemas.protocol import (
    ChatCompletionRequest,
    SampleCursor,
    chat_logprobs,
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

    def _envelope(self, kind: str, choices: list[dict], **extra) -> dict:
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
        return usage(len(state.prompt_token_ids), generated, cached)

    def usage_chunk(self, state: RequestState) -> str:
        return sse(self._envelope("chat.completion.chunk", [], usage=self.usage(state)))

    def response(self, state: RequestState) -> dict:
        choices = []
        for sample in state.samples:
            output = ChoiceOutput(self.plan)
            message = output.message(sample.text, sample.finish_reason)
            choices.append(
                {
                    "index": sample.index,
                    "message": message,
                    "logprobs": self.logprobs(sample, range(len(sample.token_ids))),
                    "finish_reason": output.finish_reason(sample.finish_reason),
                    "stop_reason": sample.stop_reason,
                }
            )
        extra = {"usage": self.usage(state)}
        if state.prompt_logprobs is not None:  # vLLM's, when asked
            extra["prompt_logprobs"] = prompt_logprobs_json(state.prompt_logprobs)
        return self._envelope("chat.completion", choices, **extra)


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


async def _chat_stream(generation: Generation, context: _ChatContext):
    cursors = [SampleCursor() for _ in range(context.params.n)]
    outputs = [ChoiceOutput(context.plan) for _ in range(context.params.n)]
    state = generation.state
    try:
        for index in range(context.params.n):
            yield context.chunk(index, {"role": "assistant", "content": ""})
        async for state in generation:
            for sample, cursor, output in zip(state.samples, cursors, outputs):
                for chunk in _sample_chunks(context, sample, cursor, output):
                    yield chunk
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
    prepared = await off_loop(prepare_chat, model, body, request.headers)
    generation = await or_disconnect(request, Generation.of_chat(model, prepared, started_at))
    context = _ChatContext(body, model, prepared.params, prepared.plan)
    if body.stream:
        return EventStream(_chat_stream(generation, context), generation.aclose)
    state = await or_disconnect(request, generation.collect())
    return await off_loop(context.response, state)
