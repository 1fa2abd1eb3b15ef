"""The chat pipeline up to the engine, shared by the chat route, `/v1/messages`, `/v1/responses`
and Ollama's `/api/chat` and `/api/generate`: the template renders the messages, the images are
fetched and their placeholders expanded, the output plan (reasoning, tool calls, structured
output) and the sampling params are made (`prepare_chat`)."""

from __future__ import annotations

from typing import NamedTuple

from axon.sampling_params import SamplingParams
from axon.server.chat_output import ChatOutputPlan
from axon.server.generation import vocab_size
from axon.server.images import checked_image_parts, with_images
from axon.server.reasoning_budget import thinking_fields, with_reasoning_effort
from axon.server.sampling import build_sampling_params
from axon.server.schemas.protocol import ChatCompletionRequest


def chat_prompt(
    model, body: ChatCompletionRequest, param: str = "messages"
) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids (the template adds the special tokens itself)."""
    messages = [message.template_dict() for message in body.messages]
    # Passed only when set: a renderer that continues no message need not know the flag.
    continuing = {"continue_final_message": True} if body.continue_final_message else {}
    kwargs = body.chat_template_kwargs
    text = model.render_chat(messages, body.tools, kwargs, body.generation_prompt(), **continuing)
    return text, model.encode(text, add_special_tokens=False, param=param)


class PreparedChat(NamedTuple):
    text: str
    prompt_ids: list[int]
    plan: ChatOutputPlan
    params: SamplingParams
    images: dict | None  # the engine's image inputs, placeholders in prompt_ids expanded


def prepare_chat(
    model,
    body: ChatCompletionRequest,
    headers,
    sampling=None,
    prompt_field: str = "messages",
    budget_param: str = "thinking_token_budget",
) -> PreparedChat:
    """Everything a chat request needs before the engine: the prompt text and ids, the output
    plan, the sampling params (from `sampling`, default `body`: /v1/responses has its own
    request) and the images, fetched, decoded and preprocessed, with the prompt's image
    placeholders expanded. Request-sized, blocking work: run it off the event loop.
    `budget_param` names the request's thinking budget in an error."""
    body = with_reasoning_effort(model, body)
    messages = [message.template_dict() for message in body.messages]
    parts = checked_image_parts(model, messages, prompt_field)
    text, prompt_ids = chat_prompt(model, body, param=prompt_field)
    plan = ChatOutputPlan.of(model, body, text, headers)
    prompt_ids, images = with_images(model, parts, prompt_ids, prompt_field)
    params = build_sampling_params(
        sampling or body,
        len(prompt_ids),
        model.max_model_len,
        model.generation_defaults,
        prompt_field=prompt_field,
        structured_output=plan.structured_output,
        vocab_size=vocab_size(model),
        thinking=thinking_fields(model, body.thinking_token_budget, text, budget_param),
    )
    return PreparedChat(text, prompt_ids, plan, params, images)
