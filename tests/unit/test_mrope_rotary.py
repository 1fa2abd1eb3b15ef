"""MRotaryEmbedding (interleaved M-RoPE, partial rotary) against transformers' own rotary
embeddings and `apply_rotary_pos_emb` for Qwen3.5, Qwen3-VL and (blocked layout) Qwen2-VL, on
positions with distinct t / h / w rows; and equal to RotaryEmbedding when the rows are equal."""

from __future__ import annotations

import pytest
import torch

from axon.layers.rotary import MRotaryEmbedding, RotaryEmbedding, mrope_axis_of
from axon.models.mrope import mrope_positions, mrope_text_positions

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig  # noqa: E402

VISION_START, IMAGE, MERGE = 1, 2, 2
NUM_HEADS, NUM_KV_HEADS = 3, 2


def _hf_case(name: str):
    """(HF rotary module, its apply_rotary_pos_emb, head_dim, rotary_dim, rope params)."""
    if name.startswith("qwen3_5"):
        # Tiny (head 32, half rotated) and the real layout (head 256, a quarter rotated).
        head_dim, factor, section = (32, 0.5, [3, 3, 2]) if name == "qwen3_5" else (256, 0.25, None)
        params = {"rope_type": "default", "rope_theta": 10_000_000.0}
        params |= {"partial_rotary_factor": factor, "mrope_interleaved": True}
        params["mrope_section"] = section or [11, 11, 10]
        config = Qwen3_5TextConfig(head_dim=head_dim, rope_parameters=params)
        rotary, apply = qwen3_5.Qwen3_5TextRotaryEmbedding(config), qwen3_5.apply_rotary_pos_emb
        return rotary, apply, head_dim, int(head_dim * factor), params
    if name.startswith("qwen3_vl"):
        head_dim, section = (32, [6, 5, 5]) if name == "qwen3_vl" else (128, [24, 20, 20])
        params = {"rope_type": "default", "rope_theta": 5_000_000.0}
        params |= {"mrope_section": section, "mrope_interleaved": True}
        config = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters=params)
        rotary, apply = qwen3_vl.Qwen3VLTextRotaryEmbedding(config), qwen3_vl.apply_rotary_pos_emb
        return rotary, apply, head_dim, head_dim, params
    params = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 4, 4]}
    config = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=2, rope_parameters=params)
    rotary = qwen2_vl.Qwen2VLRotaryEmbedding(config)
    return rotary, qwen2_vl.apply_rotary_pos_emb, 32, 32, params


def _axon_rotary(head_dim: int, rotary_dim: int, params: dict) -> MRotaryEmbedding:
    # Qwen3.5 / Qwen3-VL configs say mrope_interleaved (transformers interleaves them regardless);
    # Qwen2-VL has no such key and uses blocks.
    interleaved = params.get("mrope_interleaved", False)
    return MRotaryEmbedding(
        head_dim, rotary_dim, 4096, params, params["mrope_section"], interleaved
    )


def _image_prompt_positions() -> torch.Tensor:
    """[3, T]: text, a 4x6-patch image, text, a 2-frame 6x4 image, text, then decode tokens
    far out (large positions exercise fp32 rounding of position * inv_freq)."""
    tokens = [7, 8, VISION_START] + [IMAGE] * 6 + [3, 9, 10, 11, VISION_START]
    tokens += [IMAGE] * 12 + [3, 12]
    positions, delta = mrope_positions(tokens, [(1, 4, 6), (2, 6, 4)], MERGE, IMAGE, VISION_START)
    assert not torch.equal(positions[0], positions[1])  # the rows really differ
    decode = mrope_text_positions(5000, 4, delta)
    return torch.cat((positions, decode), dim=1)  # [3, T]


@pytest.mark.parametrize(
    "name", ["qwen3_5", "qwen3_5_real", "qwen3_vl", "qwen3_vl_real", "qwen2_vl"]
)
def test_mrope_matches_transformers(name):
    torch.manual_seed(0)
    hf_rotary, hf_apply, head_dim, rotary_dim, params = _hf_case(name)
    rotary = _axon_rotary(head_dim, rotary_dim, params)
    positions = _image_prompt_positions()
    num_tokens = positions.shape[1]
    q = torch.randn(num_tokens, NUM_HEADS, head_dim)  # [T, H, D]
    k = torch.randn(num_tokens, NUM_KV_HEADS, head_dim)  # [T, Hkv, D]

    hf_cos, hf_sin = hf_rotary(q, positions.unsqueeze(1))  # [1, T, rotary_dim], from [3, 1, T]
    cos, sin = rotary.cos_sin(positions)  # [T, rotary_dim / 2]
    torch.testing.assert_close(torch.cat((cos, cos), -1), hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), hf_sin[0], atol=1e-6, rtol=0)

    hf_q, hf_k = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    out_q, out_k = rotary(positions, q.clone(), k.clone())
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=0)
    # The pass-through channels of a partial rotary are untouched.
    assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_vl", "qwen2_vl"])
def test_equal_rows_are_plain_rope(name):
    torch.manual_seed(1)
    _, _, head_dim, rotary_dim, params = _hf_case(name)
    mrotary = _axon_rotary(head_dim, rotary_dim, params)
    plain = RotaryEmbedding(head_dim, rotary_dim, 4096, params)
    text = torch.tensor([0, 1, 2, 3, 17, 18, 250, 4095, 70_000])
    q = torch.randn(len(text), NUM_HEADS, head_dim)
    k = torch.randn(len(text), NUM_KV_HEADS, head_dim)
    want_q, want_k = plain.forward_ref(text, q, k)
    got_q, got_k = mrotary(text.expand(3, -1), q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_one_row_positions_take_the_plain_path():
    """Positions [T] give exactly RotaryEmbedding.forward, fused CPU path (in place) included."""
    torch.manual_seed(2)
    _, _, head_dim, rotary_dim, params = _hf_case("qwen3_5")
    mrotary = _axon_rotary(head_dim, rotary_dim, params)
    plain = RotaryEmbedding(head_dim, rotary_dim, 4096, params)
    positions = torch.arange(40, 48)
    q = torch.randn(8, NUM_HEADS, head_dim)
    k = torch.randn(8, NUM_KV_HEADS, head_dim)
    want_q, want_k = plain(positions, q.clone(), k.clone())
    got_q, got_k = mrotary(positions, q.clone(), k.clone())
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    ref_q, ref_k = mrotary.forward_ref(positions, q, k)
    assert torch.equal(ref_q, plain.forward_ref(positions, q, k)[0])
    assert torch.equal(ref_k, plain.forward_ref(positions, q, k)[1])


def test_axis_layouts():
    # Qwen3.5's 32 rotated pairs: T,H,W repeated, the last two pairs T,H.
    assert mrope_axis_of(32, [11, 11, 10], True).tolist() == [0, 1, 2] * 10 + [0, 1]
    # Qwen3-VL's 64 pairs: H and W stop at 3*20; pairs 60..63 stay T.
    assert mrope_axis_of(64, [24, 20, 20], True).tolist() == [0, 1, 2] * 20 + [0] * 4
    assert mrope_axis_of(6, [3, 2, 1], False).tolist() == [0, 0, 0, 1, 1, 2]


def test_bad_sections_and_positions_raise():
    with pytest.raises(ValueError, match="3 non-negative"):
        mrope_axis_of(8, [4, 4], True)
    with pytest.raises(ValueError, match="must sum"):
        mrope_axis_of(8, [4, 2, 1], False)
    rotary = MRotaryEmbedding(16, 16, 64, {"rope_theta": 1e4}, [3, 3, 2])
    q = torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match=r"\[3, T\]"):
        rotary(torch.zeros(2, 4, dtype=torch.int64), q, q)
