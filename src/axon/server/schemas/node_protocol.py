"""Bodies of the node-management API (neuron's shapes): the ModelSpec that `POST /models/load`
and `default_models` carry, and what `GET /models` returns.

EngineArgs and ModelSpec are built from the settings table (axon/settings.py): a field for each
setting, converted and checked by the table's `Setting.convert`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

from axon.server.errors import BadRequest
from axon.server.lifecycle.discovery import host_memory
from axon.settings import ENGINE, SPEC, Setting, engine_kwargs, select

HARNESS = "axon"
ModelStatus = Literal["loading", "loaded", "poisoned", "recovering", "failed"]


def _fits_the_host(value: int | None) -> int | None:
    """`value`, unless it is more bytes than this host has memory: such a cache could never be
    allocated. Read from /proc/meminfo, never from a device (the HTTP process opens none);
    a GPU with more memory than its host is the one case this refuses wrongly."""
    total = host_memory()["total_bytes"]
    if value is not None and total and value > total:
        raise ValueError(f"{value} bytes is more than this host's {total} bytes of memory")
    return value


def _convert(cls, value: Any, info: ValidationInfo) -> Any:
    """The table's conversion and check (settings.py), before pydantic's type check."""
    return None if value is None else _BY_FIELD[info.field_name].convert(value)


def _fields(chosen: list[Setting]) -> dict[str, Any]:
    """Pydantic fields for `chosen`, each optional: None leaves the next source's value."""
    fields = {}
    for setting in chosen:
        kind = setting.annotation or (
            Literal[setting.choices] if setting.choices else setting.kind  # type: ignore[valid-type]
        )
        fields[setting.field] = (kind | None, Field(None, description=setting.help))
    return fields


def _model(name: str, doc: str, base: type[BaseModel], chosen: list[Setting]) -> Any:
    """The pydantic model `name`: `base` with a field for each of `chosen`."""
    convert = field_validator(*(s.field for s in chosen), mode="before")(_convert)
    validators = {f"_convert_{name}": convert}  # a subclass's own name: the base's stays
    return create_model(
        name,
        __base__=base,
        __doc__=doc,
        __module__=__name__,
        __validators__=validators,
        **_fields(chosen),
    )


_BY_FIELD = {setting.field: setting for setting in (*select(ENGINE), *select(SPEC))}


class _EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    _check_fits = field_validator("kv_cache_memory", mode="after", check_fields=False)(
        _fits_the_host
    )

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments this object sets (the None ones left out), under the engine's
        names (`limit_mm_per_prompt.image` is `max_images_per_prompt`)."""
        return engine_kwargs({name: getattr(self, name) for name in EngineArgs.model_fields})


EngineArgs = _model(
    "EngineArgs",
    "Engine arguments under vLLM's names (the engine settings of settings.py); None leaves the "
    "engine's (or the server's) default.",
    _EngineArgs,
    select(ENGINE),
)


class _ModelSpec(EngineArgs):
    model_id: str = Field(min_length=1, description="local path, or [scheme:]org/name[@revision]")
    harness: str | None = None

    @property
    def served_id(self) -> str:
        """The id the model is served (and unloaded) under."""
        return self.served_model_name or self.model_id

    def check_harness(self) -> None:
        """Raises BadRequest unless the harness is axon's (or unset)."""
        if self.harness not in (None, HARNESS):
            raise BadRequest(
                f"unknown harness {self.harness!r}: this node runs {HARNESS!r}", param="harness"
            )


ModelSpec = _model(
    "ModelSpec",
    "What to load: neuron's ModelSpec (model_id, harness and the one-model settings of "
    "settings.py) plus axon's engine arguments.",
    _ModelSpec,
    select(SPEC, without=(ENGINE,)),
)


class UnloadRequest(BaseModel):
    model_id: str = Field(min_length=1)


class MemoryInfo(BaseModel):
    used_bytes: int
    free_bytes: int
    total_bytes: int


class ModelInfo(BaseModel):
    """One element of `GET /models`."""

    id: str
    model_id: str  # the source it was loaded from (equal to `id` unless served_model_name is set)
    harness: str = HARNESS
    status: ModelStatus
    devices: list[int] = []
    memory: MemoryInfo | None = None
    vram_used_mb: int | None = None
    capabilities: list[str] = []
    max_model_len: int | None = None
    created: int | None = None
    error: str | None = None  # why the last recovery attempt failed (recovering, failed)
    recovery_attempt: int | None = None  # recovering: the engine start under way; failed: last
    recovery_attempts: int | None = None  # recovering, failed: how many starts it gets
    engine_pid: int | None = None  # the model's engine process (its group holds every rank)
    load_progress: dict[str, int] | None = None  # loading: {"loaded_bytes", "total_bytes"}
    # loaded: {"total", "active"}, the weights' bytes and those one token reads (a mixture of
    # experts reads only its chosen experts)
    parameter_bytes: dict[str, int] | None = None
    activation_precision: str | None = None  # loaded: float32 or int8, `auto` resolved
