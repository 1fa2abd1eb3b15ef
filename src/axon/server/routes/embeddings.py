"""`POST /v1/embeddings` in OpenAI's shape, for models served with the embed task: each input's
pooled hidden state (see engine/pooler.py), as floats or base64 of little-endian float32, with
Matryoshka truncation (`dimensions`) where the checkpoint says its vectors allow it."""

from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import Field

from axon.server.errors import BadRequest
from axon.server.generation import or_disconnect, request_model, vocab_size
from axon.server.offload import json_response, off_loop
from axon.server.schemas.protocol import OpenAIModel, parse_request

router = APIRouter()


class EmbeddingRequest(OpenAIModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted, as OpenAI's; nothing is tracked per user
    add_special_tokens: bool = True  # vLLM's extra


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    body = await off_loop(parse_request, await request.body(), EmbeddingRequest)
    model = await request_model(request, body.model)
    model.size_caps.check_sequences(len(embedding_inputs(body)), prompts_param="input")
    prompts = await off_loop(embedding_prompts, body, model)
    vectors = await or_disconnect(request, model.embed(prompts))
    return await json_response(embedding_response, body, model, prompts, vectors)


def embedding_inputs(body: EmbeddingRequest) -> list:
    """The inputs the request carries, as sent (texts or token-id lists)."""
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        return [inputs]
    return inputs


def embedding_prompts(body: EmbeddingRequest, model) -> list[list[int]]:
    """The token ids of each input: texts tokenized, token-id lists checked."""
    inputs = embedding_inputs(body)
    if not inputs:
        raise BadRequest("input must not be empty", param="input")
    _check_dimensions(body.dimensions, model)
    vocab = vocab_size(model)
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            item = model.encode(item, add_special_tokens=body.add_special_tokens, param="input")
        elif any(t < 0 or (vocab and t >= vocab) for t in item):
            raise BadRequest(f"input token ids must be in [0, {vocab})", param="input")
        if not item:
            raise BadRequest("input must not be empty: an input has no tokens", param="input")
        prompts.append(list(item))
    return prompts


def _check_dimensions(dimensions: int | None, model) -> None:
    """Raises BadRequest unless `dimensions` is unset or a Matryoshka length this model has."""
    if dimensions is None or getattr(model, "task", "generate") != "embed":
        return  # a generate-task model is refused by embed() with its own message
    info = model.client.info
    pooling, hidden = info.get("pooling") or {}, info.get("hidden_size")
    if not pooling.get("matryoshka"):
        raise BadRequest(
            f"model {model.id!r} does not support Matryoshka truncation: leave dimensions unset "
            f"(its embeddings have {hidden} dimensions)",
            param="dimensions",
        )
    allowed = pooling.get("matryoshka_dimensions")
    if (allowed and dimensions not in allowed) or (hidden and dimensions > hidden):
        raise BadRequest(
            f"dimensions must be one of {allowed or f'1..{hidden}'}, got {dimensions}",
            param="dimensions",
        )


def _truncate(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The vector's first `dimensions` values, L2-normalised again if the model normalises
    (as sentence-transformers' truncate_dim followed by its Normalize module)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    vector = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in vector)) if normalize else 0.0
    return [x / norm for x in vector] if norm > 0 else vector


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(body: EmbeddingRequest, model, prompts: list[list[int]], vectors) -> dict:
    normalize = bool((model.client.info.get("pooling") or {}).get("normalize"))
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": _encode(
                _truncate(vector, body.dimensions, normalize), body.encoding_format
            ),
        }
        for index, vector in enumerate(vectors)
    ]
    num_tokens = sum(len(ids) for ids in prompts)
    return {
        "object": "list",
        "data": data,
        "model": body.model,  # the name the client sent: an alias stays one
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
