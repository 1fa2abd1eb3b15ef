"""An OpenAI request's sampling fields -> `SamplingParams`, with the model's generation_config.json
defaults for whatever the request leaves out, and the context-length check done up front."""

from __future__ import annotations

from dataclasses import fields

from axon.sampling_params import SamplingParams
from axon.server.errors import BadRequest, ContextLengthExceeded
from axon.server.schemas.protocol import SamplingRequest

# What a field defaults to when neither the request nor generation_config.json sets it (OpenAI's
# defaults; top_k/min_p/repetition_penalty disabled).
FALLBACK_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, fields_: tuple):
    """Raises ContextLengthExceeded when the prompt, or the prompt plus `max_tokens`, does not
    fit; `fields_` names the (prompt field, max-tokens field) for the error's `param`."""
    prompt_field, max_field = fields_
    if prompt_len >= max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens; reduce the length of the {prompt_field}.",
            param=prompt_field,
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Reduce the prompt or {max_field}.",
            param=max_field,
        )


def check_prompt_ids(prompt_ids, param: str):
    """`prompt_ids`, unless there are none: an empty prompt has no position to sample from, and
    reaching the engine it would fail the step (a 503) instead of the request (a 400)."""
    if not prompt_ids:
        raise _empty_prompt(param)
    return prompt_ids


def _empty_prompt(param: str) -> BadRequest:
    return BadRequest(f"{param} must not be empty: it has no tokens", param=param)


def _sampling_defaults(request: SamplingRequest, generation_defaults: dict) -> dict:
    """The five generation_config fields: the request's value, else the model's, else OpenAI's."""
    chosen = {}
    for name, fallback in FALLBACK_DEFAULTS.items():
        value = getattr(request, name)
        chosen[name] = value if value is not None else generation_defaults.get(name, fallback)
    return chosen


def _engine_fields(request: SamplingRequest, generation_defaults: dict) -> dict:
    """The SamplingParams fields that come straight from the request (or its defaults)."""
    values = _sampling_defaults(request, generation_defaults)
    values.update(
        n=request.requested_n(),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        seed=request.seed,
        min_tokens=request.min_tokens,
        stop=request.stop or [],
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()} or None,
        prompt_logprobs=request.requested_prompt_logprobs(),
    )
    return values


def build_sampling_params(
    request: SamplingRequest,
    prompt_len: int,
    max_model_len: int,
    generation_defaults: dict | None = None,
    prompt_field: str = "messages",
    structured_output: dict | None = None,
    vocab_size: int | None = None,
    thinking: dict | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for `request` on a prompt of `prompt_len` tokens.

    Raises ContextLengthExceeded when it cannot fit, BadRequest (param naming the request's
    field) for an invalid value. An omitted max_tokens means "up to the context length".
    `thinking`: the budget's fields (reasoning_budget.thinking_fields), its answer reserve
    capped at a quarter of max_tokens.
    """
    if prompt_len < 1:  # e.g. a chat template that renders to nothing
        raise _empty_prompt(prompt_field)
    max_tokens, max_field = request.requested_max_tokens()
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{max_field} must be >= 1, got {max_tokens}", param=max_field)
    check_context(prompt_len, max_tokens, max_model_len, (prompt_field, max_field))
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    logprobs, logprobs_field = request.requested_logprobs()
    if request.stream and request.prompt_logprobs is not None:
        message = "prompt_logprobs are not available when stream is true"
        raise BadRequest(message, param="prompt_logprobs")
    values = _engine_fields(request, generation_defaults or {})
    if vocab_size and any(token >= vocab_size for token in values["logit_bias"] or ()):
        raise BadRequest(
            f"logit_bias keys must be token ids below {vocab_size}", param="logit_bias"
        )
    values.update(max_tokens=max_tokens, logprobs=logprobs, structured_output=structured_output)
    if thinking:
        reserve = min(thinking.get("answer_reserve_tokens", 0), max_tokens // 4)
        values.update(thinking, answer_reserve_tokens=reserve)
    renames = {"max_tokens": max_field, "logprobs": logprobs_field}
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        name = str(exc).split(" ", 1)[0]
        param = renames.get(name, name) if name in _PARAM_NAMES else None
        raise BadRequest(
            str(exc).replace(name, param, 1) if param else str(exc), param=param
        ) from exc
