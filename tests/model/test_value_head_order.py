"""GatedDeltaNet's value-head orders: a "tiled" layer (llama.cpp's GGUF layout, value head j reads
key head j % Hk) on weights whose value heads are permuted as llama.cpp's converter permutes them
computes what a "grouped" layer (HF's layout, j reads j // (Hv/Hk)) computes on the original
weights, through chunked prefill and decode with carried state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from axon.layers.forward_context import AttentionMetadata, PrefillChunk, set_forward_context
from axon.layers.linear_attention import GatedDeltaNet

from .qwen3_5_tiny import swap_value_heads

CONFIG = SimpleNamespace(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # 3 value heads per key head: the permutation is no involution
    linear_key_head_dim=8,
    linear_value_head_dim=4,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)
PROMPT_LENGTHS = (7, 70)  # 70 > the 64-token chunk of the chunked delta rule
# fp32 rounding only (out_proj sums the value heads in another order), relative to the output.
REL_TOL = 5e-6


def _random_layer(order: str, seed: int = 0) -> GatedDeltaNet:
    layer = GatedDeltaNet(CONFIG, value_head_order=order)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        layer.A.copy_(-torch.rand(layer.A.shape, generator=generator) * 2)  # decay rates < 0
    return layer


def _to_tiled(grouped: GatedDeltaNet, order: str = "tiled") -> GatedDeltaNet:
    """A layer in `order` holding `grouped`'s weights with the value heads in tiled order."""
    hk, hv = CONFIG.linear_num_key_heads, CONFIG.linear_num_value_heads
    ratio, dv = hv // hk, CONFIG.linear_value_head_dim

    def heads(tensor, dim, head_dim):
        return swap_value_heads(tensor, dim, hk, ratio, head_dim)

    key_dim = 2 * grouped.key_dim  # q and k channels keep their order
    state = {name: p.detach().clone() for name, p in grouped.named_parameters()}
    for name in ("in_proj_qkv.weight", "conv1d.weight"):
        qk, v = state[name][:key_dim], state[name][key_dim:]
        state[name] = torch.cat([qk, heads(v, 0, dv)])
    state["in_proj_z.weight"] = heads(state["in_proj_z.weight"], 0, dv)
    for name in ("in_proj_a.weight", "in_proj_b.weight", "A", "dt_bias"):
        state[name] = heads(state[name], 0, 1)
    state["out_proj.weight"] = heads(state["out_proj.weight"], 1, dv)
    layer = GatedDeltaNet(CONFIG, value_head_order=order)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(state[name])
    return layer


def _bind_state(layer: GatedDeltaNet, slots: int) -> None:
    conv, recurrent = layer.state_shapes()
    layer.conv_state = torch.zeros(slots, *conv)
    layer.recurrent_state = torch.zeros(slots, *recurrent)


def _prefill_meta(lengths) -> AttentionMetadata:
    chunks, start = [], 0
    for slot, length in enumerate(lengths):
        chunks.append(PrefillChunk(start, length, length, torch.arange(length), state_slot=slot))
        start += length
    return AttentionMetadata(torch.zeros(start, dtype=torch.long), chunks, None, None, None)


def _decode_meta(num_seqs: int) -> AttentionMetadata:
    rows = torch.arange(num_seqs)
    return AttentionMetadata(rows, [], rows, rows[:, None], rows + 1, decode_state_slots=rows)


@torch.no_grad()
def _run(layer: GatedDeltaNet, seed: int = 1) -> list[torch.Tensor]:
    """Outputs of a two-sequence prefill batch, then two decode steps, from zero state."""
    _bind_state(layer, len(PROMPT_LENGTHS))
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(sum(PROMPT_LENGTHS), CONFIG.hidden_size, generator=generator)
    with set_forward_context(_prefill_meta(PROMPT_LENGTHS)):
        outputs = [layer(hidden)]
    for _ in range(2):
        step = torch.randn(len(PROMPT_LENGTHS), CONFIG.hidden_size, generator=generator)
        with set_forward_context(_decode_meta(len(PROMPT_LENGTHS))):
            outputs.append(layer(step))
    return outputs


def test_tiled_order_on_permuted_weights_equals_grouped():
    grouped = _random_layer("grouped")
    want = _run(grouped)
    got = _run(_to_tiled(grouped))
    for step, (a, b) in enumerate(zip(got, want)):
        diff, scale = float((a - b).abs().max()), float(b.abs().max())
        assert diff <= REL_TOL * scale, f"step {step}: max abs diff {diff:.3e} of {scale:.3e}"


def test_the_order_matters():
    """The grouped layer on the permuted weights computes something else: the option is what
    makes the tiled weights work."""
    grouped = _random_layer("grouped")
    want = _run(grouped)
    wrong = _run(_to_tiled(grouped, order="grouped"))
    for a, b in zip(wrong, want):
        assert float((a - b).abs().max()) > 1e-2 * float(b.abs().max())


def test_unknown_order_is_rejected():
    with pytest.raises(ValueError, match="value_head_order"):
        GatedDeltaNet(CONFIG, value_head_order="interleaved")
