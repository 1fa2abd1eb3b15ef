"""Engine configuration: frozen data built once and validated at the edge. Its fields, defaults
and checks are the engine settings of axon/settings.py; the checks between settings are here."""

from __future__ import annotations

import functools
import os
from dataclasses import field, make_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads where a device is touched: the HTTP process never needs it
    import torch

from axon import speculative_config
from axon.settings import DTYPE_NAMES, LLM, engine_kwargs, select

_FIELDS = [s for s in select(LLM) if s.to_engine is None]  # the rest stand for fields
_FP8_ON_CPU = (
    "fp8_e4m3 needs a GPU with float8 (compute capability 8.9+): the CPU's kernels read "
    "float32, float16 and q8_0 caches (q8_0 is the CPU's 8-bit cache)"
)
# Cache element types other than torch's float names: their storage dtypes' names.
_KV_STORAGE = {"q8_0": "uint8", "fp8_e4m3": "float8_e4m3fn"}


def _check(config, ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {getattr(config, name)!r}")


class _EngineConfigBase:
    """EngineConfig's checks and methods; its fields are the settings taken by LLM
    (axon/settings.py), `model` first."""

    def __post_init__(self) -> None:
        for setting in _FIELDS:  # each value in its setting's type, or a ValueError
            value = getattr(self, setting.name)
            if isinstance(value, speculative_config.SpeculativeConfig):
                value = value.as_dict()
            object.__setattr__(self, setting.name, setting.convert(value))
        # Held parsed (a `replace` hands the parsed object back in: as_dict first).
        spec = speculative_config.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        check = functools.partial(_check, self)
        check(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes})")
        check(
            self.tensor_parallel_size % self.nnodes == 0,
            "tensor_parallel_size",
            f"must be a multiple of nnodes {self.nnodes}",
        )
        check(
            self.activation_precision != "int8" or str(self.model).lower().endswith(".gguf"),
            "activation_precision",
            f"int8 applies to GGUF weights only, and {self.model!r} is not a .gguf file",
        )
        check(
            self.kv_cache_dtype != "fp8_e4m3" or self.device != "cpu",
            "kv_cache_dtype",
            _FP8_ON_CPU,
        )

    @property
    def vision_enabled(self) -> bool:
        """Whether a checkpoint's vision tower is loaded."""
        return self.enable_vision and self.max_images_per_prompt > 0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """Build from keyword engine arguments (None: the default); an unknown name or a bad
        value is a ValueError."""
        known = {setting.name for setting in select(LLM)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        return cls(model=model, **engine_kwargs(kwargs))

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model running in `model_dtype` (the runner asks once the
        model is loaded, with `auto` activations resolved): q8_0 is uint8 (layers/kv_quant.py).
        fp8_e4m3 off a float8 GPU is a ValueError."""
        import torch

        if self.kv_cache_dtype == "fp8_e4m3":
            device = self.torch_device()
            _check(self, device.type == "cuda", "kv_cache_dtype", _FP8_ON_CPU)
            _check(self, torch.cuda.get_device_capability(device) >= (8, 9), "kv_cache_dtype",
                   "fp8_e4m3 needs compute capability 8.9+ (Ada, Hopper); use q8_0")  # fmt: skip
        if self.kv_cache_dtype in _KV_STORAGE:
            return getattr(torch, _KV_STORAGE[self.kv_cache_dtype])
        if self.kv_cache_dtype != "auto":
            return getattr(torch, DTYPE_NAMES[self.kv_cache_dtype])
        return torch.float16 if self.activation_precision == "int8" else model_dtype

    def torch_dtype(self, hf_config) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPE_NAMES[self.dtype])
        if self.torch_device().type == "cpu":
            return torch.float32
        checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint, str):
            checkpoint = getattr(torch, DTYPE_NAMES.get(checkpoint, ""), None)
        return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16


def _field(setting) -> tuple:
    if setting.env is not None:  # read here, the edge, and carried down in the config
        default = field(default_factory=lambda: setting.from_env(os.environ))
    else:
        default = field(default=setting.default)
    return setting.name, Any, default


# Frozen data: `EngineConfig(model=..., max_num_seqs=8)`; vLLM's names where vLLM has one.
EngineConfig = make_dataclass(
    "EngineConfig",
    [("model", str), *(_field(s) for s in _FIELDS)],
    bases=(_EngineConfigBase,),
    frozen=True,
)
EngineConfig.__module__ = __name__
EngineConfig.__doc__ = """Engine arguments: `model` and the settings `LLM` takes (settings.py).

Built once, at the edge (LLM, the engine process, a headless node): a setting with an env var
(AXON_TP_ALLREDUCE, AXON_TP_STEP_TIMEOUT_S) takes the variable's value when it is not given."""
