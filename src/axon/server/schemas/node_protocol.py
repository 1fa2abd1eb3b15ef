"""Bodies of the node-management API (neuron's shapes): the ModelSpec that `POST /models/load`
and `default_models` carry, and what `GET /models` returns."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from axon.server.errors import BadRequest
from axon.server.lifecycle.discovery import host_memory

HARNESS = "axon"
ModelStatus = Literal["loading", "loaded", "poisoned", "recovering"]
DTYPES = ("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")


def _parse_size(value: Any) -> Any:
    if isinstance(value, str):
        from axon.cli import parse_size  # the CLI's size grammar: 512M, 2G, 1.5GiB

        return parse_size(value)
    return value


def _fits_the_host(value: int | None) -> int | None:
    """`value`, unless it is more bytes than this host has memory: such a cache could never be
    allocated. Read from /proc/meminfo, never from a device (the HTTP process opens none);
    a GPU with more memory than its host is the one case this refuses wrongly."""
    total = host_memory()["total_bytes"]
    if value is not None and total and value > total:
        raise ValueError(f"{value} bytes is more than this host's {total} bytes of memory")
    return value


class EngineArgs(BaseModel):
    """Engine arguments under vLLM's names; None leaves the engine's (or the server's) default."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal[DTYPES] | None = None  # type: ignore[valid-type]
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    kv_cache_memory: int | None = Field(None, gt=0, description="bytes, or a size: 512M, 2G")
    enable_prefix_caching: bool | None = None
    # vLLM's {"image": N}: images per request; 0 loads a multimodal checkpoint text-only.
    limit_mm_per_prompt: dict[Literal["image"], int] | None = None
    max_image_pixels: int | None = Field(None, ge=1, description="pixels per resized image")
    image_profile: Literal["native", "fixed448"] | None = None
    # "embed" serves /v1/embeddings only; "auto": embed for a sentence-transformers checkpoint.
    task: Literal["auto", "generate", "embed"] | None = None
    # "int8": 8-bit activations for every step on GGUF weights (EngineConfig).
    activation_precision: Literal["float32", "int8"] | None = None
    # The KV cache's element type; "auto": float16 with int8 activations, else the model's.
    kv_cache_dtype: Literal[DTYPES] | None = None  # type: ignore[valid-type]
    # CPU: n or n - 1 OpenMP threads, whichever steps faster (runner/adaptive_threads.py).
    adaptive_threads: bool | None = None

    _check_size = field_validator("kv_cache_memory", mode="before")(_parse_size)
    _check_fits = field_validator("kv_cache_memory", mode="after")(_fits_the_host)

    @field_validator("limit_mm_per_prompt", mode="after")
    @classmethod
    def _check_limits(cls, value: dict | None) -> dict | None:
        if value is not None and any(count < 0 for count in value.values()):
            raise ValueError(f"limit_mm_per_prompt counts must be >= 0, got {value}")
        return value

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments this object sets (the None ones left out), under the engine's
        names (`limit_mm_per_prompt.image` is `max_images_per_prompt`)."""
        values = {name: getattr(self, name) for name in EngineArgs.model_fields}
        limits = values.pop("limit_mm_per_prompt")
        if limits is not None and "image" in limits:
            values["max_images_per_prompt"] = limits["image"]
        return {name: value for name, value in values.items() if value is not None}


class ModelSpec(EngineArgs):
    """What to load: neuron's ModelSpec plus axon's engine arguments."""

    model_id: str = Field(min_length=1, description="local path, or [scheme:]org/name[@revision]")
    harness: str | None = None
    quant: str | None = None
    revision: str | None = None
    tensor_parallel: int | None = Field(None, ge=1)
    devices: list[int] | None = None
    served_model_name: str | None = Field(None, min_length=1)
    chat_template: str | None = Field(None, min_length=1, description="template file override")

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
    error: str | None = None  # why the last recovery failed, while one is being retried
    engine_pid: int | None = None  # the model's engine process (its group holds every rank)
    load_progress: dict[str, int] | None = None  # loading: {"loaded_bytes", "total_bytes"}
    # loaded: {"total", "active"}, the weights' bytes and those one token reads (a mixture of
    # experts reads only its chosen experts)
    parameter_bytes: dict[str, int] | None = None
