"""8-bit activations for a whole model: one switch over every GGML weight it holds (linear
layers, the tied LM head, mixture-of-experts experts), beside both kinds of module it flips."""

from __future__ import annotations

from torch import nn

from axon.kernels import ggml_cpu
from axon.layers.fused_moe import QuantizedExperts
from axon.layers.quantized import QuantizedEmbedding, QuantizedMatmul, QuantizedParts


def use_int8_activations(model: nn.Module) -> int:
    """Switches every GGML matmul of `model` (before its first forward) to 8-bit activations
    (kernels/ggml_q8.py) at every step size, batch-1 decode included: linear layers, the one-call
    decoder layer (layers/fused_decode.py) and mixture-of-experts experts; returns how many GGML
    weights that covers. Raises ValueError when none (no GGUF weights on the CPU)."""
    kinds = (QuantizedMatmul, QuantizedParts, QuantizedEmbedding, QuantizedExperts)
    switched = 0
    for module in model.modules():
        if isinstance(module, kinds):
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
