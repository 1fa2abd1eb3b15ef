"""Request schemas of the OpenAI routes (chat, completions, responses) and the builders of their
response bodies.

Requests are validated in pydantic's strict mode from the raw JSON, so a wrong type (`"n": "2"`,
`"temperature": "hot"`) is a 400 naming the field rather than a silent coercion; a JSON integer
still passes for a float; NaN and infinities (which Python's JSON reader takes) are refused
everywhere. Fields no route knows are ignored: OpenAI clients send extras.

Bounds: `n` and `best_of` <= 128 and `top_logprobs` <= 20 (OpenAI's), `seed` in int64 (vLLM's);
axon's own: at most 16 stop strings of at most 1,000 characters each (OpenAI allows 4), 128
stop_token_ids, 300 logit_bias entries; tools and schemas: see request_checks.py.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from axon.server.errors import AxonHTTPError, BadRequest
from axon.server.schemas.request_checks import (
    check_content_parts,
    check_response_format,
    check_tool_choice,
    check_tools,
    non_finite_path,
)

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple"}

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS_ENTRIES = 300
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-100, le=100)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


def random_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def param_of(loc: tuple) -> str | None:
    """`messages[0].content` from pydantic's loc, without its union-member tags."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
            continue
        if part.split("[")[0] in _TYPE_TAGS or "[" in part or "-" in part:
            break
        param += f".{part}" if param else part
    return param or None


def parse_request(raw: bytes, schema: type[T]) -> T:
    """The request body `raw` validated as `schema`; raises BadRequest naming the bad field."""
    try:
        return schema.model_validate_json(raw or b"")
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise BadRequest(f"request body is not valid JSON: {errors[0]['msg']}") from None
        param = param_of(errors[0]["loc"])
        problems = [e["msg"] for e in errors if param_of(e["loc"]) == param]
        where = f"{param}: " if param else "request body: "
        raise BadRequest(where + "; or ".join(dict.fromkeys(problems)), param=param) from None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """The sampling fields every generating route shares: OpenAI's names plus vLLM's extras."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[TokenIdKey, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    prompt_logprobs: int | None = None  # vLLM's; refused until computed (SamplingParams)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    # Fields whose JSON pydantic leaves untyped, so NaN can hide in them.
    free_form: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _check_free_form(self):
        for name in self.free_form:
            where = non_finite_path(getattr(self, name), name)
            if where is not None:
                raise BadRequest(f"{where} must be a finite number", param=where)
        self.check_shapes()
        return self

    def check_shapes(self) -> None:
        """Raises BadRequest for a field of the wrong shape or size (see request_checks)."""
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            message = f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            raise BadRequest(message, param="stop")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion-length cap the request sets (None: as long as the context allows), and
        the field it came from."""
        return getattr(self, "max_tokens", None), "max_tokens"

    def requested_n(self) -> int:
        return 1

    def requested_logprobs(self) -> tuple[int | None, str]:
        """How many top logprobs per token (None: no logprobs), and the field that set it."""
        return None, "logprobs"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---- chat -----------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    """One message; extras (`tool_calls`, `tool_call_id`, `name`, ...) go to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict:
        """The message with its extras, content parts verbatim: the renderer normalises it into
        the shape templates take (tokenizer/messages.py: null content, parts, arguments)."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: NumSamples = 1
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    free_form = ("messages", "tools", "tool_choice", "response_format", "chat_template_kwargs")

    def check_shapes(self) -> None:
        super().check_shapes()
        for index, message in enumerate(self.messages):
            check_content_parts(message.content, f"messages[{index}].content")
        check_tools(self.tools, flat=False)
        check_tool_choice(self.tool_choice)
        check_response_format(self.response_format)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def requested_n(self) -> int:
        return self.n

    def requested_logprobs(self) -> tuple[int | None, str]:
        if not self.logprobs:
            if self.top_logprobs:
                raise BadRequest("top_logprobs requires logprobs: true", param="top_logprobs")
            return None, "logprobs"
        return self.top_logprobs or 0, "top_logprobs"


# ---- completions ----------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    n: NumSamples = 1
    best_of: NumSamples | None = None
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def requested_n(self) -> int:
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of other than n is not supported", param="best_of")
        return self.n

    def requested_logprobs(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"


# ---- responses ------------------------------------------------------------------------------


class ResponsesRequest(SamplingRequest):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    free_form = ("input", "tools", "tool_choice", "chat_template_kwargs")

    def check_shapes(self) -> None:
        super().check_shapes()
        check_tools(self.tools, flat=True)
        check_tool_choice(self.tool_choice)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_output_tokens, "max_output_tokens"


# ---- response bodies ------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _ranked(entry: dict, limit: int) -> list:
    """The `limit` best alternatives of one position, best first."""
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank or 1 << 30, -item[1].logprob))
    return ranked[:limit]


def _token_text(entry: dict, token_id: int, decode) -> str:
    lp = entry.get(token_id)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(token_id)


def chat_logprobs(token_ids: list[int], entries: list[dict], top: int, decode) -> dict:
    """Chat's `logprobs` object for the tokens `token_ids` (their `entries` of token id ->
    Logprob); `decode(token_id)` names a token the entry does not."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        token = _token_text(entry, token_id, decode)
        alternatives = []
        for alt_id, alt in _ranked(entry, top):
            alt_token = _token_text(entry, alt_id, decode)
            alternatives.append(
                {"token": alt_token, "logprob": alt.logprob, "bytes": _token_bytes(alt_token)}
            )
        content.append(
            {
                "token": token,
                "logprob": entry[token_id].logprob,
                "bytes": _token_bytes(token),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content}


def completion_logprobs(
    token_ids: list[int], entries: list[dict], top: int, decode, text_offset: int = 0
) -> dict:
    """The legacy completions `logprobs` object; offsets count from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        token = _token_text(entry, token_id, decode)
        tokens.append(token)
        token_logprobs.append(entry[token_id].logprob)
        offsets.append(text_offset)
        text_offset += len(token)
        top_logprobs.append(
            {_token_text(entry, alt_id, decode): alt.logprob for alt_id, alt in _ranked(entry, top)}
        )
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason under OpenAI's name (an aborted sample reads as `stop`)."""
    return "stop" if reason == "abort" else reason


class SampleCursor:
    """What of one sample has been streamed: tokens, text offset, whether its end was sent."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.text_offset = 0
        self.done = False

    def advance(self, sample) -> tuple[str, range] | None:
        """(text delta, new token positions) since the last call, or None when nothing is new
        and the end has been sent."""
        if self.done:
            return None
        text = sample.new_text()
        positions = range(self.num_tokens, len(sample.token_ids))
        self.num_tokens = len(sample.token_ids)
        self.done = sample.finished
        if not text and not positions and not self.done:
            return None
        return text, positions


# ---- server-sent events --------------------------------------------------------------------


def sse(data: dict | str, event: str | None = None) -> str:
    compact = (",", ":")
    payload = (
        data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=compact)
    )
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def error_body(exc: Exception) -> dict:
    """The error envelope for a failure after the stream has started (unexpected ones logged)."""
    if not isinstance(exc, AxonHTTPError):
        logger.error("stream failed", exc_info=exc)
        exc = AxonHTTPError(f"internal error: {type(exc).__name__}")
        exc.error_type, exc.code = "internal_error", "internal_error"
    return exc.body()


def error_event(exc: Exception) -> str:
    return sse(error_body(exc))
