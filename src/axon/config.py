"""Engine configuration: frozen dataclasses built once and validated at the edge."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a device is touched: the HTTP process never needs it
    import torch

# --dtype names -> torch's names for them
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def _check(config, ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {getattr(config, name)!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine arguments, under vLLM's names where vLLM has one."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype (or bf16) on GPU
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's context, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes for the KV cache; overrides the fraction
    kv_cache_memory_fraction: float = 0.9  # of free device memory (GPU); CPU uses a fixed cap
    seed: int = 0
    # Hybrid (Gated DeltaNet) models: with prefix caching, the recurrent state is snapshotted
    # every `state_snapshot_stride` blocks, into a pool of `num_state_snapshots` (default
    # max_num_seqs) that shares the cache memory budget with the KV blocks and state slots.
    state_snapshot_stride: int = 16
    num_state_snapshots: int | None = None
    # Multimodal checkpoints (Qwen3.5, Qwen3-VL): False, or max_images_per_prompt 0 (vLLM's
    # `limit_mm_per_prompt={"image": 0}`), loads the text model only, skipping the vision
    # tower's weights and memory.
    enable_vision: bool = True
    max_images_per_prompt: int = 16
    # A cap on an image's pixels after resizing: it lowers the top of the checkpoint's pixel
    # band (Qwen3.5's reaches 16M pixels, 65k patches), and the memory plan reserves the
    # tower's activations for the largest image it allows. None: the checkpoint's band.
    max_image_pixels: int | None = 1 << 20
    image_profile: str = "native"  # or "fixed448": neuron's, every image resized to 448x448
    # Ranks of one model: the engine process is rank 0 and spawns ranks 1..N-1 (gloo on CPU,
    # NCCL on CUDA, rank i on cuda:i of the devices the engine sees).
    tensor_parallel_size: int = 1
    # Multi-host tensor parallelism (vLLM's and SGLang's names): `nnodes` hosts hold
    # tensor_parallel_size / nnodes consecutive ranks each. Node 0 runs the engine (rank 0),
    # the others `axon serve --headless`; every rank meets in torch.distributed's TCP store at
    # master_addr:master_port, which node 0 hosts.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # "generate" samples tokens; "embed" returns each prompt's pooled hidden state instead
    # (prefill only). "auto": embed when the checkpoint has a sentence-transformers pooling
    # config (modules.json), else generate.
    task: str = "auto"
    # "int8": every step (batch-1 decode included) on GGUF weights quantizes each token's
    # activations to 8 bits per block (llama.cpp's Q8_K / Q8_0) and uses integer dot products;
    # "float32" (the default) is the exact path.
    activation_precision: str = "float32"
    # The KV cache's element type. "auto": float16 with activation_precision="int8" (half the
    # bytes a decode step reads, as llama.cpp's default cache), else the model's dtype; or one
    # of float32, float16, bfloat16 (and their short names).
    kv_cache_dtype: str = "auto"
    # CPU: switch between n and n - 1 OpenMP threads while running, keeping the faster (a core
    # busy with another process); off when OMP_NUM_THREADS is set (runner/adaptive_threads.py).
    adaptive_threads: bool = True

    def __post_init__(self) -> None:
        check = functools.partial(_check, self)

        check(
            self.dtype == "auto" or self.dtype in _DTYPES,
            "dtype",
            f"must be auto or one of {sorted(_DTYPES)}",
        )
        check(self.block_size >= 1, "block_size", "must be >= 1")
        check(
            self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2"
        )
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.state_snapshot_stride >= 1, "state_snapshot_stride", "must be >= 1")
        check(
            self.num_state_snapshots is None or self.num_state_snapshots >= 0,
            "num_state_snapshots",
            "must be >= 0",
        )
        check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            "must be > 0",
        )
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        check(self.nnodes >= 1, "nnodes", "must be >= 1")
        check(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes})")
        check(
            self.tensor_parallel_size % self.nnodes == 0,
            "tensor_parallel_size",
            f"must be a multiple of nnodes {self.nnodes}",
        )
        check(0 < self.master_port < 65536, "master_port", "must be in [1, 65535]")
        self._check_features()

    def _check_features(self) -> None:
        """The per-model features (task, activation precision, images, the KV fraction)."""

        check = functools.partial(_check, self)

        check(self.task in ("auto", "generate", "embed"), "task", "must be auto, generate or embed")
        check(
            self.activation_precision in ("float32", "int8"),
            "activation_precision",
            "must be float32 or int8",
        )
        check(
            self.activation_precision == "float32" or str(self.model).lower().endswith(".gguf"),
            "activation_precision",
            f"int8 applies to GGUF weights only, and {self.model!r} is not a .gguf file",
        )
        check(
            self.kv_cache_dtype == "auto" or self.kv_cache_dtype in _DTYPES,
            "kv_cache_dtype",
            f"must be auto or one of {sorted(_DTYPES)}",
        )
        check(self.max_images_per_prompt >= 0, "max_images_per_prompt", "must be >= 0")
        check(
            self.max_image_pixels is None or self.max_image_pixels >= 1,
            "max_image_pixels",
            "must be >= 1",
        )
        check(
            self.image_profile in ("native", "fixed448"),
            "image_profile",
            "must be native or fixed448",
        )
        check(
            0.0 < self.kv_cache_memory_fraction <= 1.0,
            "kv_cache_memory_fraction",
            "must be in (0, 1]",
        )

    @property
    def vision_enabled(self) -> bool:
        """Whether a checkpoint's vision tower is loaded."""
        return self.enable_vision and self.max_images_per_prompt > 0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """Build from keyword engine arguments; an unknown name is a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine arguments {unknown}; known: {sorted(known - {'model'})}"
            )
        return cls(model=model, **{k: v for k, v in kwargs.items() if v is not None})

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model running in `model_dtype`."""
        import torch

        if self.kv_cache_dtype != "auto":
            return getattr(torch, _DTYPES[self.kv_cache_dtype])
        return torch.float16 if self.activation_precision == "int8" else model_dtype

    def torch_dtype(self, hf_config) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        if self.torch_device().type == "cpu":
            return torch.float32
        checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint, str):
            checkpoint = getattr(torch, _DTYPES.get(checkpoint, ""), None)
        return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16
