"""Request schemas of the OpenAI routes (chat, completions, responses) and the builders of their
response bodies.

Requests are validated in pydantic's strict mode from the raw JSON, so a wrong type (`"n": "2"`,
`"temperature": "hot"`) is a 400 naming the field rather than a silent coercion; a JSON integer
still passes for a float; NaN and infinities (which Python's JSON reader takes) are refused
everywhere. OpenAI's and vLLM's fields that a route does not honour are a 400 naming them
(unsupported.py); fields no schema knows are ignored: clients send their own extras.

Bounds: `n` and `best_of` <= 128 and `top_logprobs` <= 20 (OpenAI's), `seed` in int64 (vLLM's);
axon's own: at most 16 stop strings of at most 1,000 characters each (OpenAI allows 4), 128
stop_token_ids, 300 logit_bias entries; tools and schemas: see request_checks.py.
"""

from __future__ import annotations

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
from axon.server.offload import dumps_json
from axon.server.schemas.logprobs import chat_logprobs as chat_logprobs
from axon.server.schemas.logprobs import completion_logprobs as completion_logprobs
from axon.server.schemas.request_checks import (
    check_content_parts,
    check_continuation,
    check_response_format,
    check_tool_choice,
    check_tools,
    non_finite_path,
)
from axon.server.schemas.unsupported import CHAT, COMPLETIONS, refuse_unsupported

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
    # OpenAI's padding of stream events against a length side channel: nothing to hide locally.
    include_obfuscation: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused (check_shapes)


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
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, its logprob and top k
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    # Fields whose JSON pydantic leaves untyped, so NaN can hide in them.
    free_form: ClassVar[tuple[str, ...]] = ()
    # OpenAI's and vLLM's fields this route refuses rather than drops (unsupported.py).
    unsupported: ClassVar[dict] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, raw: Any) -> Any:
        refuse_unsupported(raw, cls.unsupported, cls.model_fields)
        return raw

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
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            param = "stream_options.continuous_usage_stats"
            raise BadRequest(f"{param} is not supported", param=param, code="unsupported_field")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            message = f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            raise BadRequest(message, param="stop")

    def requested_prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token gets (None: the prompt is not scored)."""
        return self.prompt_logprobs

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
    # A thinking budget in tokens (vLLM's), or OpenAI's effort mapped to one (reasoning_budget.py).
    thinking_token_budget: int | None = Field(None, ge=0)
    reasoning_effort: str | None = None
    continue_final_message: bool = False

    free_form = ("messages", "tools", "tool_choice", "response_format", "chat_template_kwargs")
    unsupported = CHAT

    def check_shapes(self) -> None:
        super().check_shapes()
        for index, message in enumerate(self.messages):
            check_content_parts(message.content, f"messages[{index}].content")
        sent = "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt
        check_continuation(self.continue_final_message, sent, [m.role for m in self.messages])
        check_tools(self.tools, flat=False)
        check_tool_choice(self.tool_choice)
        check_response_format(self.response_format)

    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's header: never while continuing (vLLM's)."""
        return self.add_generation_prompt and not self.continue_final_message

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
    thinking_token_budget: int | None = Field(None, ge=0)  # vLLM's (reasoning_budget.py)

    unsupported = COMPLETIONS

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the answer is the prompt alone (OpenAI's legacy API)."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> tuple[int | None, str]:
        # The engine samples one token, which the answer leaves out.
        return (1 if self.echo_only else self.max_tokens), "max_tokens"

    def requested_prompt_logprobs(self) -> int | None:
        """vLLM's: `echo` with `logprobs` scores the prompt (as many top logprobs)."""
        echoed = self.logprobs if self.echo else None
        return self.prompt_logprobs if self.prompt_logprobs is not None else echoed

    def requested_n(self) -> int:
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of other than n is not supported", param="best_of")
        return self.n

    def requested_logprobs(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"


# ---- response bodies ------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    drafts: tuple[int, int] = (0, 0),
) -> dict:
    """OpenAI's usage block. `drafts`: (drafted, accepted) draft tokens of speculative decoding,
    under OpenAI's names for Predicted Outputs' tokens (`completion_tokens_details`: accepted /
    rejected prediction tokens), which its clients read; absent when nothing was drafted."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    drafted, accepted = drafts
    if drafted:
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return body


def draft_totals(samples) -> tuple[int, int]:
    """(drafted, accepted) draft tokens over `samples` (SampleStates)."""
    drafted = sum(sample.num_draft_tokens for sample in samples)
    return drafted, sum(sample.num_accepted_tokens for sample in samples)


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
    """One server-sent event; a dict is encoded as whole answers are (offload.dumps_json)."""
    payload = data if isinstance(data, str) else dumps_json(data).decode()
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
