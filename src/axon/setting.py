"""What an engine setting is (`Setting`) and the value grammars settings share: sizes
(`512M`), image limits (`image=4`), dtype names. The table of settings is in settings.py.

Stdlib only: the HTTP process and `axon --help` import it, torch must not load with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

# Where a setting is taken (`Setting.where`).
GENERATE = "generate"  # a flag of `axon generate` and `axon chat`
SERVE = "serve"  # a flag of `axon serve`
ENGINE = "engine"  # an engine argument of every load: /models/load, [engine], [[default_models]]
SPEC = "spec"  # one model's load only: /models/load and [[default_models]]
LLM = "llm"  # a keyword argument of `LLM(...)`, a field of EngineConfig
EVERYWHERE = (GENERATE, SERVE, ENGINE, LLM)

# dtype names (vLLM's and their short forms) -> torch's names; "auto" besides.
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPES = ("auto", *DTYPE_NAMES)

# Binary units: 512M is 512 MiB. An optional B or iB may follow (512MB, 512MiB, 100B).
_SIZE_RE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?:(?P<unit>[kmgt])(?:i?b)?|b)?", re.I)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_KIND_RULES = {
    int: "must be an integer",
    float: "must be a number",
    bool: "must be true or false",
    str: "must be a string",
    dict: "must be a table",
    list: "must be a list",
}


def parse_size(text: str) -> int:
    """Returns the byte count that `text` names: "1024", "512M", "2G", "1.5GiB" (binary units).

    Raises ValueError for anything else, or for a size that is not a whole number of bytes.
    """
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 512M, 2G)")
    unit = (match.group("unit") or "").lower()
    size = Fraction(match.group("number")) * _SIZE_UNITS[unit]
    if size.denominator != 1:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(size)


def parse_mm_limits(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt`: `image=4`, or vLLM's JSON `{"image": 4}`. Raises ValueError."""
    try:
        value = json.loads(text) if text.lstrip().startswith("{") else None
        if value is None:
            pairs = [item.partition("=") for item in text.split(",")]
            if any(not sep for _, sep, _ in pairs):
                raise ValueError(text)
            value = {key.strip(): int(count) for key, _, count in pairs}
    except ValueError:
        raise ValueError(f"expected image=N, got {text!r}") from None
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ValueError(f"only image=N is supported, got {text!r}")
    return value


class SettingError(ValueError):
    """A refused value: "<name> <rule>, got <value>"."""

    def __init__(self, name: str, rule: str, value: Any, message: str | None = None):
        super().__init__(message or f"{name} {rule}, got {value!r}")
        self.rule, self.value = rule, value


@dataclass(frozen=True)
class Setting:
    """One engine setting. `convert` is its one validation, whichever entry point it came by."""

    name: str  # the LLM keyword, EngineConfig field, load field and flag (--max-num-seqs)
    kind: type  # int, float, bool, str, dict or list
    default: Any  # the engine's (None for a spec setting: nothing is passed on)
    help: str
    where: tuple[str, ...]
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # what `check` (or `choices`) asks, for the message: "must be >= 1"
    choices: tuple | None = None
    shown: tuple | None = None  # the choices --help lists, when not all of them
    parse: Callable[[str], Any] | None = None  # text (a flag, an env var, TOML) -> value
    nullable: bool = False  # None is a value (besides a None default)
    annotation: Any = None  # the load schema's type, when `kind` says too little
    env: str | None = None  # read when an EngineConfig is made without the setting
    lenient_env: bool = False  # a bad value in `env` means the default
    load_name: str | None = None  # the load field, when not `name`
    to_engine: Callable[[Any], dict] | None = None  # the engine keywords it stands for
    cli_default: bool = False  # `axon generate` passes the default on, not leaving it out
    metavar: str | None = None

    @property
    def field(self) -> str:
        """Its name in a load body and the config file."""
        return self.load_name or self.name

    def convert(self, value: Any) -> Any:
        """`value` in this setting's type, checked. Raises SettingError (a ValueError)."""
        if value is None:
            if self.default is None or self.nullable:
                return None
            raise SettingError(self.name, "must be set", value)
        if isinstance(value, str) and self.parse is not None:
            try:
                value = self.parse(value)
            except ValueError as exc:
                rule, message = f"is not valid ({exc})", f"{self.name}: {exc}"
                raise SettingError(self.name, rule, value, message) from None
        typed = _typed(self.kind, value)
        if typed is _REFUSED:
            raise SettingError(self.name, _KIND_RULES[self.kind], value)
        if self.choices is not None and typed not in self.choices:
            raise SettingError(self.name, self.rule or _choices_rule(self.choices), typed)
        if self.check is not None and not self.check(typed):
            raise SettingError(self.name, self.rule, typed)
        return typed

    def from_env(self, environ: Mapping[str, str]) -> Any:
        """The value of `env` in `environ`, else the default. Raises ValueError naming the
        variable, unless a bad value means the default (`lenient_env`)."""
        text = environ.get(self.env) if self.env else None
        if text is None:
            return self.default
        try:
            return self.convert(text)
        except SettingError as exc:
            if self.lenient_env:
                return self.default
            raise SettingError(self.env, exc.rule, exc.value) from None


_REFUSED = object()


def _typed(kind: type, value: Any) -> Any:
    """`value` as `kind` (text as a flag or an env var spells it), or _REFUSED."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower() if isinstance(value, str | int) else None
        return True if text in _TRUE else False if text in _FALSE else _REFUSED
    if isinstance(value, bool):
        return _REFUSED
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return _number(int, value)
    if kind is float:
        return float(value) if isinstance(value, int | float) else _number(float, value)
    return value if isinstance(value, kind) else _REFUSED


def _number(kind: type, value: Any) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return kind(value.strip()) if isinstance(value, str) else _REFUSED
    except ValueError:
        return _REFUSED


def _choices_rule(choices: tuple) -> str:
    names = [str(choice) for choice in choices]
    return "must be " + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])
