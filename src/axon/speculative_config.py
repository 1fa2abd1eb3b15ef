"""Speculative decoding's configuration (`--speculative-config`, a load spec's
`speculative_config`, `LLM(speculative_config=...)`): vLLM's object and key names.

Stdlib only: the HTTP process and `axon --help` import it, torch must not load with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
_DRAFT_MODEL_KEYS = ("model", "quant", "dtype", "activation_precision")
_PRECISIONS = ("auto", "float32", "int8")
_MAX_SPECULATIVE_TOKENS = 32
# A hybrid model keeps k recurrent states per drafting sequence for the rollback, for at most
# this many sequences a step (more sequences verify no drafts in that step).
MAX_DRAFTING_SEQS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are made: `method`, and `num_speculative_tokens` (k) drafted per step.

    n-gram: the longest suffix of the sequence between `prompt_lookup_min` and
    `prompt_lookup_max` tokens long that occurred earlier proposes the tokens that followed it.
    draft_model: `model` (a path or repo, as the target's), with its own `quant`, `dtype` and
    `activation_precision` (the target's when None).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    quant: str | None = None
    dtype: str | None = None
    activation_precision: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The object as given: method, k and the keys that differ from their defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return {
            name: value
            for name, value in asdict(self).items()
            if name in ("method", "num_speculative_tokens") or value != defaults[name]
        }

    def describe(self) -> str:
        """One line for the load log."""
        extra = (
            f"lookup {self.prompt_lookup_min}-{self.prompt_lookup_max}"
            if self.method == "ngram"
            else f"draft {self.model}"
            if self.method == "draft_model"
            else "the model's MTP head"
        )
        return f"speculative decoding: {self.method}, k={self.num_speculative_tokens} ({extra})"


def draft_state_rows(config) -> int:
    """Scratch recurrent-state rows a hybrid model needs for `config`'s drafts (an
    EngineConfig): k per sequence that may draft in one step."""
    spec = config.speculative_config
    if spec is None:
        return 0
    return spec.num_speculative_tokens * min(config.max_num_seqs, MAX_DRAFTING_SEQS)


def parse_text(text: str) -> dict[str, Any]:
    """The command line's and the config file's spelling: JSON (`{"method": "ngram", ...}`) or
    `method=ngram,num_speculative_tokens=4` pairs (numbers as integers)."""
    if text.lstrip().startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        return value
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if not pairs or any(not sep for _, sep, _ in pairs):
        raise ValueError(f"expected a JSON object or key=value pairs, got {text!r}")
    return {key.strip(): _scalar(value.strip()) for key, _, value in pairs}


def _scalar(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def parse(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """`value` as a SpeculativeConfig (None stays None). Raises ValueError naming the key
    for an unknown key, a missing one or a bad value."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        value = parse_text(value)
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be an object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: {sorted(known)}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(
            f"speculative_config.method must be one of {list(METHODS)}, got {method!r}"
        )
    _check_int(value, "num_speculative_tokens", 1, required=True)
    _check_int(value, "prompt_lookup_min", 1)
    _check_int(value, "prompt_lookup_max", 1)
    for key in ("model", "quant", "dtype"):
        if value.get(key) is not None and (not isinstance(value[key], str) or not value[key]):
            raise ValueError(f"speculative_config.{key} must be a non-empty string")
    if value.get("activation_precision") not in (None, *_PRECISIONS):
        raise ValueError(f"speculative_config.activation_precision must be one of {_PRECISIONS}")
    config = SpeculativeConfig(**value)
    _check_method_keys(config, value)
    return config


def _check_int(value: dict, key: str, low: int, required: bool = False) -> None:
    if key not in value:
        if required:
            raise ValueError(f"speculative_config.{key} is required")
        return
    number = value[key]
    top = _MAX_SPECULATIVE_TOKENS if key == "num_speculative_tokens" else 1 << 16
    if type(number) is not int or not low <= number <= top:
        raise ValueError(
            f"speculative_config.{key} must be an integer in [{low}, {top}], got {number!r}"
        )


def _check_method_keys(config: SpeculativeConfig, value: dict) -> None:
    """Keys that only one method reads are refused with another: never silently ignored."""
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(
            "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
            f"{config.prompt_lookup_min} > {config.prompt_lookup_max}"
        )
    lookup_keys = [k for k in ("prompt_lookup_min", "prompt_lookup_max") if k in value]
    model_keys = [k for k in _DRAFT_MODEL_KEYS if value.get(k) is not None]
    if config.method != "ngram" and lookup_keys:
        raise ValueError(f"speculative_config.{lookup_keys[0]} applies to method ngram only")
    if config.method != "draft_model" and model_keys:
        raise ValueError(f"speculative_config.{model_keys[0]} applies to method draft_model only")
    if config.method == "draft_model" and config.model is None:
        raise ValueError("speculative_config.model is required by method draft_model")


def check(value: Any) -> bool:
    """The settings table's check: True, or a ValueError that names the key."""
    parse(value)
    return True
