"""vLLM's utility routes: `POST /tokenize` (a prompt, or chat messages rendered with the model's
chat template), `POST /detokenize`, `GET /tokenizer_info` and `GET /version`, in vLLM's request
and response shapes. lm-eval's `remote` tokenizer back-end needs exactly /tokenizer_info,
/tokenize and /detokenize.

`model` may be left out while exactly one model is served (vLLM serves one). Tokenizing counts
a text longer than the context too (that is what the route is for) and refuses nothing but bad
input; `/tokenize` and `/detokenize` need the API key when one is set, `/version` does not.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

import axon
from axon.server.errors import BadRequest
from axon.server.generation import served_model, vocab_size
from axon.server.images import checked_image_parts, with_images
from axon.server.offload import off_loop
from axon.server.schemas.protocol import ChatMessage, OpenAIModel, TokenId, parse_request
from axon.server.schemas.request_checks import (
    check_content_parts,
    check_continuation,
    check_tools,
)
from axon.tokenizer.chat_template import CHATML_TEMPLATE

router = APIRouter()  # behind the API key
open_router = APIRouter()


class TokenizeRequest(OpenAIModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("send exactly one of prompt and messages", param="prompt")
        if self.continue_final_message and self.messages is None:
            message = "continue_final_message needs messages"
            raise BadRequest(message, param="continue_final_message")
        sent = "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt
        roles = [message.role for message in self.messages or []]
        check_continuation(self.continue_final_message, sent, roles)
        if self.chat_template is not None:
            message = "chat_template is not supported per request; set it when loading the model"
            raise BadRequest(message, param="chat_template")
        for index, message in enumerate(self.messages or []):
            check_content_parts(message.content, f"messages[{index}].content")
        check_tools(self.tools, flat=False)
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


def _model(request: Request, model_id: str | None):
    """The model `model_id` names, or the only one served when it names none."""
    if model_id is not None:
        return served_model(request, model_id)
    models = request.app.state.axon.registry.list_models()
    if len(models) != 1:
        message = f"model is required: {len(models)} models are served"
        raise BadRequest(message, param="model")
    return models[0]


def _tokenize(model, body: TokenizeRequest) -> dict:
    """The prompt's token ids; chat images count as the tokens the engine would see (their
    placeholders expanded), so the count is the one a chat request's usage reports."""
    parts = []
    if body.messages is not None:
        messages = [message.template_dict() for message in body.messages]
        parts = checked_image_parts(model, messages, "messages")
        kwargs = body.chat_template_kwargs
        continuing = body.continue_final_message
        generation_prompt = body.add_generation_prompt and not continuing
        text = model.render_chat(messages, body.tools, kwargs, generation_prompt, continuing)
        special = bool(body.add_special_tokens)  # the template wrote the special tokens
    else:
        text = body.prompt
        special = body.add_special_tokens is not False
    tokens = model.encode(text, add_special_tokens=special)
    tokens, _ = with_images(model, parts, tokens, "messages")
    result = {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}
    strings = model.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {**result, "token_strs": strings}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    body = await off_loop(parse_request, await request.body(), TokenizeRequest)
    return await off_loop(_tokenize, _model(request, body.model), body)


def _detokenize(model, body: DetokenizeRequest) -> dict:
    vocab = vocab_size(model)
    if vocab and any(token >= vocab for token in body.tokens):
        raise BadRequest(f"tokens must be token ids below {vocab}", param="tokens")
    if model.tokenizer is None:
        raise BadRequest(f"model {model.id!r} has no tokenizer", param="model")
    return {"prompt": model.tokenizer.decode(body.tokens)}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    body = await off_loop(parse_request, await request.body(), DetokenizeRequest)
    return await off_loop(_detokenize, _model(request, body.model), body)


# tokenizer_config.json entries that name files on the server's disk, not the tokenizer.
_FILE_KWARGS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path"})
_MISSING = object()


def _json_value(value: Any) -> Any:
    """`value` as JSON (an AddedToken as its text, mapping keys as strings); a value JSON
    cannot hold is left out, as _MISSING."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(getattr(value, "content", None), str):  # an AddedToken
        return value.content
    if isinstance(value, dict):
        pairs = ((str(key), _json_value(item)) for key, item in value.items())
        return {key: item for key, item in pairs if item is not _MISSING}
    if isinstance(value, list | tuple):
        return [item for item in map(_json_value, value) if item is not _MISSING]
    return _MISSING


def _tokenizer_info(model) -> dict:
    """vLLM's TokenizerInfoResponse: the tokenizer's configuration (its tokenizer_config.json
    as loaded: special tokens, added tokens, ...), `tokenizer_class`, the chat template the
    server renders with, and `model_max_length` as the context this model is served with."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise BadRequest(f"model {model.id!r} has no tokenizer", param="model")
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    info = _json_value({k: v for k, v in kwargs.items() if k not in _FILE_KWARGS})
    info["tokenizer_class"] = type(tokenizer).__name__
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = _json_value(getattr(tokenizer, name, None))
    template = model.chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    info["chat_template"] = template if isinstance(template, str) else CHATML_TEMPLATE
    info["model_max_length"] = model.max_model_len
    return info


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict:
    return await off_loop(_tokenizer_info, _model(request, model))


@open_router.get("/version")
async def version() -> dict:
    return {"version": axon.__version__}
