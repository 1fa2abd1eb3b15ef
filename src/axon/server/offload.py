"""Request-sized work off the event loop: chat-template rendering, tokenization, building and
encoding a large response. It runs on its own small thread pool, not asyncio's default one, so a
burst of long prompts cannot starve the threads that `/health`, the model registry and the
engine clients rely on."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
from fastapi.encoders import jsonable_encoder
from starlette.responses import Response

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="axon-prompt")
# How deep encode_json descends before one orjson call takes the rest: a chat answer's
# body > choices > choice > logprobs > content, so no single call (which holds the GIL, and so
# the event loop) encodes more than one choice's token list.
_SPLIT_DEPTH = 4


async def off_loop(function, /, *args, **kwargs):
    """`function(*args, **kwargs)` on the request pool; its exception is raised here."""
    call = functools.partial(contextvars.copy_context().run, function, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_POOL, call)


async def json_response(function, /, *args) -> Response:
    """The JSON response of the body `function(*args)` returns, built and encoded on the pool:
    a 55 MB answer (n: 128 with top_logprobs) no longer stalls every other request while
    FastAPI's encoder and json.dumps walk it on the loop."""
    return Response(
        await off_loop(_built_and_encoded, function, args), media_type="application/json"
    )


def _built_and_encoded(function, args) -> bytes:
    return encode_json(function(*args))


def encode_json(value) -> bytes:
    """Compact UTF-8 JSON of `value` (orjson, ~50x FastAPI's encoder and json.dumps), the outer
    lists and objects an item at a time, so that the GIL (and with it the event loop) is free
    between items. Floats are the shortest text that reads back as the same float, as json.dumps
    writes them (though `1e-05` is spelt `0.00001`); NaN and infinities are written as null,
    which every client parses (json.dumps wrote `-Infinity`, which JavaScript's and Go's parsers
    refuse, or failed)."""
    parts: list[bytes] = []  # a list or object may hold an iterator (a generator of choices)
    _encode_into(parts, value, _SPLIT_DEPTH)
    return b"".join(parts)  # one copy of the whole body, however deep the split went


def _encode_into(parts: list[bytes], value, depth: int) -> None:
    if depth and (isinstance(value, list) and value or isinstance(value, Iterator)):
        parts.append(b"[")  # an iterator's items are built as they are encoded
        for index, item in enumerate(value):
            if index:
                parts.append(b",")
            _encode_into(parts, item, depth - 1)
        parts.append(b"]")
    elif depth and type(value) is dict and value and all(type(key) is str for key in value):
        separator = b"{"
        for key, item in value.items():
            parts += (separator, orjson.dumps(key), b":")
            _encode_into(parts, item, depth - 1)
            separator = b","
        parts.append(b"}")
    else:
        parts.append(dumps_json(value))


def dumps_json(value) -> bytes:
    """`value` as compact JSON in one orjson call (encode_json's floats and NaN)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:  # what orjson does not take (pydantic models, int keys)
        # What FastAPI's encoder did for a route's returned dict: models and other objects
        # through jsonable_encoder, non-string keys as strings.
        return orjson.dumps(value, default=jsonable_encoder, option=orjson.OPT_NON_STR_KEYS)


async def maybe_off_loop(wide: bool, function, /, *args):
    """`function(*args)`: on the pool for a wide request (several choices, or logprobs), whose
    stream steps each build many chunks; inline otherwise, where one token's chunk costs less
    than the hop to a thread."""
    return await off_loop(function, *args) if wide else function(*args)
