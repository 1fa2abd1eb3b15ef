"""Ollama's `options`, `format`, `keep_alive` and `think` -> what axon's chat pipeline takes.

Every option Ollama defines is decided here, none dropped:

- honoured: temperature, top_k, top_p, min_p, seed (negative: a random seed, Ollama's -1),
  stop, repeat_penalty (axon's repetition_penalty, over the prompt and the output),
  presence_penalty, frequency_penalty, num_predict (-1 and -2: up to the context), num_ctx
  (the request's context window, at most the model's max_model_len);
- accepted only at the value that changes nothing in axon's sampler: mirostat 0, typical_p 1,
  tfs_z 1, repeat_last_n -1 (the penalty's window is the whole context), penalize_newline false;
- refused (a 400 naming it): mirostat_tau, mirostat_eta and num_keep (no mirostat sampler, no
  context shifting), and the load-time options (numa, num_batch, num_gpu, main_gpu, low_vram,
  f16_kv, logits_all, vocab_only, use_mmap, use_mlock, embedding_only, num_thread), which are
  the engine settings a model is loaded with (`axon serve` flags, `POST /models/load`).
"""

from __future__ import annotations

import re
from typing import Any

from axon.server.errors import BadRequest

# Ollama option -> the chat request field it sets.
_SAMPLING = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_predict": "max_tokens",
}
# Options whose one accepted value is what axon does anyway.
_NEUTRAL = {
    "mirostat": (0, "axon has no mirostat sampler: send 0 or leave it out"),
    "typical_p": (1, "axon has no typical sampling: send 1.0 or leave it out"),
    "tfs_z": (1, "axon has no tail-free sampling: send 1.0 or leave it out"),
    "repeat_last_n": (-1, "axon's repeat_penalty covers the whole context: send -1"),
    "penalize_newline": (False, "axon never exempts newlines from the penalty: send false"),
}
_REFUSED = {
    "mirostat_tau": "axon has no mirostat sampler",
    "mirostat_eta": "axon has no mirostat sampler",
    "num_keep": "axon never shifts the context, so there is nothing to keep",
}
_LOAD_TIME = (
    *("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all"),
    *("vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread"),
)
# A Go duration ("5m", "1h30m", "-1s") or a bare number of seconds.
_DURATION = re.compile(r"^[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+$")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
THINK_EFFORTS = ("low", "medium", "high")


def _refuse(name: str, reason: str) -> BadRequest:
    return BadRequest(f"options.{name}: {reason}", param=f"options.{name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_option(name: str, value: Any) -> None:
    """Raises BadRequest unless `name` is honoured, or neutral at this value."""
    if name in _NEUTRAL:
        neutral, reason = _NEUTRAL[name]
        if value == neutral and isinstance(value, bool) == isinstance(neutral, bool):
            return
        raise _refuse(name, reason)
    if name in _REFUSED:
        raise _refuse(name, _REFUSED[name] + ": it is not supported")
    if name in _LOAD_TIME:
        raise _refuse(
            name, "a load-time option: set the model's engine settings when loading it instead"
        )
    if name not in _SAMPLING and name != "num_ctx":
        raise _refuse(name, "not an option axon knows")


def sampling_fields(options: dict[str, Any] | None) -> tuple[dict, int | None]:
    """(the chat request fields `options` set, its num_ctx or None); raises BadRequest naming
    the first option axon cannot honour. Types are checked where the fields are validated."""
    fields: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if value is None:
            continue
        _check_option(name, value)
        if name == "num_predict" and _is_int(value) and value in (-1, -2):
            continue  # Ollama's "no limit" and "fill the context": up to the context
        if name == "num_predict" and _is_int(value) and value < 1:
            raise _refuse(name, f"must be >= 1, or -1 for no limit; got {value}")
        if name == "seed" and _is_int(value) and value < 0:
            continue  # Ollama's -1: a random seed
        if name in _SAMPLING:
            fields[_SAMPLING[name]] = value
    num_ctx = (options or {}).get("num_ctx")
    if num_ctx is not None and (not _is_int(num_ctx) or num_ctx < 1):
        raise _refuse("num_ctx", f"must be a positive integer, got {num_ctx!r}")
    return fields, num_ctx


def option_of(field: str) -> str:
    """The Ollama option a chat request field came from (`options.repeat_penalty`)."""
    for option, target in _SAMPLING.items():
        if target == field:
            return f"options.{option}"
    return field


def check_num_ctx(num_ctx: int | None, max_model_len: int) -> int:
    """The context window a request runs in: its num_ctx, at most the model's."""
    if num_ctx is None:
        return max_model_len
    if num_ctx > max_model_len:
        message = f"options.num_ctx: at most this model's context length {max_model_len}"
        raise BadRequest(f"{message}, got {num_ctx}", param="options.num_ctx")
    return num_ctx


def response_format(value: Any) -> dict | None:
    """Ollama's `format` ("json" or a JSON schema) as chat's response_format."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    message = f'format must be "json" or a JSON schema object, got {value!r}'
    raise BadRequest(message, param="format")


def keep_alive_seconds(value: Any) -> float | None:
    """`keep_alive` in seconds (None: not sent); a bare number is seconds, a string a Go
    duration ("5m", "-1"). Raises BadRequest for anything else."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        return float(value)
    if isinstance(value, str) and _DURATION.match(value.strip()):
        return _duration(value.strip())
    raise BadRequest(f"keep_alive: not a duration: {value!r}", param="keep_alive")


def _duration(text: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    sign = -1.0 if text.startswith("-") else 1.0
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", text)
    return sign * sum(float(number) * units[unit] for number, unit in parts)


def unload_after(keep_alive: Any) -> bool:
    """For a model loaded through the node API (`POST /models/load`), which axon never unloads
    by itself: whether it is unloaded after this request (`keep_alive` 0). A negative one (keep
    it loaded) is what happens anyway; a positive one would need an idle unload this model does
    not have: a 400 rather than a promise not kept. (The models axon manages take any
    keep_alive: `registry.touch`.)"""
    seconds = keep_alive_seconds(keep_alive)
    if seconds is None or seconds < 0:
        return False
    if seconds == 0:
        return True
    raise BadRequest(
        f"keep_alive: this model was loaded through the node API (POST /models/load) and "
        f"stays loaded until it is unloaded, so {keep_alive!r} cannot be honoured: send a "
        "negative value, or 0 to unload it after this request",
        param="keep_alive",
    )
