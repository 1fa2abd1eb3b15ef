"""Per-request sampling parameters (vLLM's names). Validation raises ValueError naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled one)
    # per prompt token after the first: its logprob and the k most likely (vLLM's); the first
    # sample computes its prompt without prefix-cache hits then
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> a value added to its logit before penalties and sampling (OpenAI's logit_bias);
    # ids past the model's logits are ignored, as stop_token_ids are.
    logit_bias: dict[int, float] | None = None
    # None, or a grammar the output must follow (see axon.structured.grammars):
    # {"type": "json_object"} | {"type": "json_schema", "schema": {...}}
    # | {"type": "tool_call", "format": "hermes" | "qwen3_coder", "tools": [...], "parallel": b}
    structured_output: dict | None = None
    # vLLM's thinking_token_budget: at most this many tokens inside the thinking part, then the
    # engine emits `thinking_end_token_ids` itself (the first closes thinking; the rest, such as
    # Qwen3's "\n\n", are what the template writes after it). The server resolves the marker ids
    # from the tokenizer, so the engine needs none. Thinking starts in the prompt
    # (`thinking_in_prompt`) or when the first generated token is `thinking_start_token_id`.
    thinking_token_budget: int | None = None
    thinking_start_token_id: int | None = None
    thinking_end_token_ids: list[int] = field(default_factory=list)
    thinking_in_prompt: bool = False
    # Room kept for the answer: thinking is cut earlier when the budget would leave less.
    answer_reserve_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._validate_floats()
        problem = _structured_output_problem(self.structured_output)
        if problem is not None:
            raise ValueError(f"structured_output {problem}, got {self.structured_output!r}")
        self._validate_thinking()

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 or >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0"
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            "must be in [0, 20]",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )

    def _validate_floats(self) -> None:
        """Non-finite values pass the range checks above (inf >= 0) and poison the logits."""
        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or not all(
            isinstance(t, int) and t >= 0 and isinstance(v, int | float) for t, v in bias.items()
        ):
            raise ValueError("logit_bias must map non-negative token ids to numbers")
        if not all(math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS for v in bias.values()):
            raise ValueError("logit_bias values must be finite numbers in [-100, 100]")

    def _validate_thinking(self) -> None:
        budget = self.thinking_token_budget
        if budget is None:
            return
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
        if not isinstance(self.answer_reserve_tokens, int) or self.answer_reserve_tokens < 0:
            raise ValueError(
                f"answer_reserve_tokens must be an integer >= 0, got {self.answer_reserve_tokens!r}"
            )
        if not self.thinking_end_token_ids:
            raise ValueError("thinking_token_budget needs the model's end-of-thinking token")

    def thinking_limit(self) -> int | None:
        """The most tokens thinking may take: the budget, cut so that the forced end and
        `answer_reserve_tokens` still fit in max_tokens. None: no budget."""
        if self.thinking_token_budget is None:
            return None
        if self.max_tokens is None:
            return self.thinking_token_budget
        room = self.max_tokens - len(self.thinking_end_token_ids) - self.answer_reserve_tokens
        return max(0, min(self.thinking_token_budget, room))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_STRUCTURED_TYPES = ("json_object", "json_schema", "tool_call")
_TOOL_FORMATS = ("hermes", "qwen3_coder")


def _structured_output_problem(spec) -> str | None:
    """Why `spec` is not a valid structured_output, or None when it is."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in _STRUCTURED_TYPES:
        return f"must be None or a dict whose type is one of {_STRUCTURED_TYPES}"
    if spec["type"] == "json_schema" and not isinstance(spec.get("schema"), dict | bool):
        return "json_schema needs a schema object"
    if spec["type"] == "tool_call":
        tools = spec.get("tools")
        if spec.get("format") not in _TOOL_FORMATS:
            return f"tool_call needs a format in {_TOOL_FORMATS}"
        if not tools or not all(isinstance(t, dict) and t.get("name") for t in tools):
            return "tool_call needs a non-empty list of tools with names"
    if spec.get("thinking") not in (None, "optional", "started"):
        return "thinking must be None, 'optional' or 'started'"
    return None
