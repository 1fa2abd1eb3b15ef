"""8-bit activations for a whole model: one switch over every GGML weight it holds (linear
layers, the tied LM head, mixture-of-experts experts), beside both kinds of module it flips;
and what the `auto` activation precision (the default) resolves to for a loaded model."""

from __future__ import annotations

import logging

from torch import nn

from axon.kernels import ggml_cpu, ggml_q8
from axon.layers.fused_moe import QuantizedExperts
from axon.layers.quantized import QuantizedEmbedding, QuantizedMatmul, QuantizedParts

logger = logging.getLogger(__name__)

_KINDS = (QuantizedMatmul, QuantizedParts, QuantizedEmbedding, QuantizedExperts)


def use_int8_activations(model: nn.Module) -> int:
    """Switches every GGML matmul of `model` (before its first forward) to 8-bit activations
    (kernels/ggml_q8.py) at every step size, batch-1 decode included: linear layers, the one-call
    decoder layer (layers/fused_decode.py) and mixture-of-experts experts; returns how many GGML
    weights that covers. Raises ValueError when none (no GGUF weights on the CPU)."""
    switched = 0
    for module in model.modules():
        if isinstance(module, _KINDS):
            module.int8 = True
        if isinstance(module, QuantizedMatmul) and module.kind == "ggml":
            switched += module.raw.device.type == "cpu"
        if isinstance(module, QuantizedExperts):
            switched += sum(
                qt.data.device.type == "cpu" and ggml_cpu.supports(qt.ggml_type)
                for qt in module._parts.values()
            )
    if switched == 0:
        raise ValueError(
            "activation_precision int8 applies to GGUF weights on the CPU; this model has none"
        )
    return switched


def set_activation_precision(setting: str, model: nn.Module) -> str:
    """Sets the loaded `model` (before its first forward) to the precision `setting` means for
    it, and returns that: float32 and int8 as they say; auto is int8 where int8 measured faster
    than llama.cpp's server at llama.cpp's own quality (docs/performance.md): quantized GGUF
    weights on the CPU, and a CPU with the 8-bit kernels' SIMD path (ggml_q8.simd). Float
    weights, a GPU, or no such kernels: float32, the exact path."""
    precision = setting
    if setting == "auto":
        precision = "int8" if _int8_weights(model) > 0 and ggml_q8.simd() else "float32"
        logger.info("activation precision auto: %s", precision)
    if precision == "int8":
        use_int8_activations(model)
    return precision


def _int8_weights(model: nn.Module) -> int:
    """How many of `model`'s weights are quantized GGML ones on the CPU that an 8-bit kernel
    multiplies (F32 / F16 GGUF tensors are float weights: none)."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedMatmul) and module.kind == "ggml":
            count += module.raw.device.type == "cpu" and ggml_q8.supports([module.ggml_type])
        if isinstance(module, QuantizedExperts):
            count += sum(
                qt.data.device.type == "cpu" and ggml_q8.supports([qt.ggml_type])
                for qt in module._parts.values()
            )
    return count
