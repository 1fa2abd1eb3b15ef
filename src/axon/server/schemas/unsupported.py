"""Request fields that OpenAI's and vLLM's schemas define and axon does not honour: sent with a
value that would change the answer, each is a 400 naming it, never accepted and dropped. A value
that asks for what axon does anyway (`store: false`, `service_tier: "auto"`, `modalities:
["text"]`) passes. A name that a request model declares as a field is never refused here, so
implementing a field retires its entry.

Fields axon takes and deliberately leaves without effect, because they ask nothing of the answer:
`user` and `safety_identifier` (end-user ids for a provider's abuse monitoring) and
`prompt_cache_key` (a cache-routing hint: the prefix cache serves every request).
"""

from __future__ import annotations

import logging
from typing import Any

from axon.server.errors import BadRequest

logger = logging.getLogger(__name__)
NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key"})
_MAX_LOGGED_NAMES = 1024  # a client inventing names must not grow the set without bound
_logged_names: set[str] = set()

_NOT_STORED = "this server stores nothing"
_NO_GUIDED = "vLLM's guided_* fields are not supported; use response_format"

# name -> (the values that pass, why any other is refused)
_OPENAI_CHAT = {
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "functions": ((), "the deprecated functions are not supported; use tools"),
    "function_call": ((), "the deprecated function_call is not supported; use tool_choice"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "verbosity": (("medium",), "only the default verbosity, medium, is supported"),
    "store": ((False,), _NOT_STORED),
    "metadata": (({},), f"metadata is kept only with stored completions; {_NOT_STORED}"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "prompt_cache_retention": (("in_memory",), "the prefix cache lives in memory only"),
    "prompt_cache_options": ((), "prompt cache options are not supported"),
    "moderation": ((), "moderation is not supported"),
}
_VLLM_COMMON = {
    "guided_json": ((), _NO_GUIDED),
    "guided_regex": ((), _NO_GUIDED),
    "guided_choice": ((), _NO_GUIDED),
    "guided_grammar": ((), _NO_GUIDED),
    "guided_decoding_backend": ((), _NO_GUIDED),
    "guided_whitespace_pattern": ((), _NO_GUIDED),
    "structured_outputs": ((), "vLLM's structured_outputs is not supported; use response_format"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty needs beam search, which is not supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": ((), "bad_words is not supported; use logit_bias"),
    "truncate_prompt_tokens": ((), "prompt truncation is not supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are always space-separated"),
    "return_tokens_as_token_ids": ((False,), "tokens as token ids are not supported"),
    "return_token_ids": ((False,), "returning token ids is not supported"),
    "priority": ((0,), "request priorities are not supported"),
    "logits_processors": ((), "logits processors are not supported"),
    "cache_salt": ((), "cache salting is not supported"),
    "kv_transfer_params": ((), "KV transfer is not supported"),
    "vllm_xargs": ((), "vllm_xargs is not supported"),
    "mm_processor_kwargs": ((), "mm_processor_kwargs is not supported"),
    "thinking_token_budget": (
        (),
        "thinking_token_budget is taken on chat and completions; on /v1/responses use "
        "reasoning.effort",
    ),
}
CHAT = {
    **_OPENAI_CHAT,
    **_VLLM_COMMON,
    "echo": ((False,), "echo is not supported on chat"),
    "documents": ((), "documents are not supported"),
    "chat_template": ((), "a per-request chat_template is not supported"),
    "add_special_tokens": ((False,), "the chat template writes the special tokens itself"),
    "request_id": ((), "client request ids are not supported"),
}
COMPLETIONS = {
    **_VLLM_COMMON,
    "response_format": ((), "response_format is supported on chat and responses only"),
    "request_id": ((), "client request ids are not supported"),
}
RESPONSES = {
    "store": ((False,), f"{_NOT_STORED}: send store: false"),
    "background": ((False,), "background responses are not supported"),
    "background_options": ((), "background responses are not supported"),
    "conversation": ((), f"conversations are not supported; {_NOT_STORED}"),
    "include": (([],), "no extra output data (include) is supported"),
    "max_tool_calls": ((), "max_tool_calls is not supported"),
    "prompt": ((), "stored prompt templates are not supported"),
    "truncation": (("disabled",), "truncation is not supported: a long input is a 400"),
    "top_logprobs": ((), "logprobs are not supported on /v1/responses"),
    "context_management": ((), "context management is not supported"),
    "access_programs": ((), "access_programs is not supported"),
    "image": ((), "image is not supported"),
    "moderation": ((), "moderation is not supported"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "prompt_cache_retention": (("in_memory",), "the prefix cache lives in memory only"),
    "prompt_cache_options": ((), "prompt cache options are not supported"),
    **_VLLM_COMMON,
}


def refuse_unsupported(raw: Any, table: dict, declared) -> None:
    """Raises BadRequest naming the first field of `raw` (a request's JSON object) that `table`
    lists, is not `declared` by the request model, and is set to a value that does not pass."""
    if not isinstance(raw, dict):
        return
    _log_unknown(raw, table, declared)
    for name, value in raw.items():
        entry = table.get(name)
        if entry is None or name in declared or value is None:
            continue
        passing, reason = entry
        if not any(value == ok and type(value) is type(ok) for ok in passing):
            raise BadRequest(f"{name}: {reason}", param=name, code="unsupported_field")


def _log_unknown(raw: dict, table: dict, declared) -> None:
    """Names no schema knows are ignored (clients send their own extras); each is logged once,
    so that a misspelt field shows in the server's log."""
    unknown = [n for n in raw if n not in declared and n not in table and n not in NO_EFFECT]
    for name in unknown:
        if name not in _logged_names and len(_logged_names) < _MAX_LOGGED_NAMES:
            _logged_names.add(name)
            logger.warning("request field %r is not known to this server: ignored", name)
