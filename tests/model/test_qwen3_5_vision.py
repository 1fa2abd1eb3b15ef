"""The vision tower and the M-RoPE positions against transformers' Qwen3.5 / Qwen3-VL.

Tiny random `Qwen3_5ForConditionalGeneration` and `Qwen3VLForConditionalGeneration` built here;
every tower weight perturbed so that a skipped bias or norm cannot pass. Two images of different
grids in one call exercise `cu_seqlens`; a 7x7 position table resampled to 4x6 and 8x4 grids
exercises the interpolation in both directions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from axon.models.mrope import mrope_positions, mrope_text_positions
from axon.models.qwen3_5_vision import (
    Qwen3_5VisionTower,
    merged_token_counts,
    varlen_attention,
    varlen_attention_ref,
)
from tiny_configs import TOWER_TEXT, TOWER_VISION

IMAGE, VIDEO, START, END = 90, 91, 92, 93  # token ids of the tiny configs
GRIDS = [[1, 4, 6], [1, 8, 4]]
_IDS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)


def _qwen3_5():
    text = {**TOWER_TEXT, "layer_types": ["full_attention"]}
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [4, 4, 4],
    }
    config = Qwen3_5Config(text_config=text, vision_config=TOWER_VISION, **_IDS)
    return Qwen3_5ForConditionalGeneration(config)


def _qwen3_vl():
    text = dict(TOWER_TEXT, rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4]})
    vision = {**TOWER_VISION, "deepstack_visual_indexes": [0, 2]}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **_IDS)
    return Qwen3VLForConditionalGeneration(config)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def reference(request):
    torch.manual_seed(0)
    model = (_qwen3_5 if request.param == "qwen3_5" else _qwen3_vl)().float().eval()
    with torch.no_grad():
        for param in model.model.visual.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _tower(reference, **kwargs) -> Qwen3_5VisionTower:
    tower = Qwen3_5VisionTower(reference.config.vision_config, **kwargs).eval()
    tower.load_weights(reference.model.visual.state_dict().items())
    return tower


def _pixels(grids, dim=3 * 2 * 16 * 16, seed=1):
    num_patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_patches, dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention_fn", [varlen_attention, varlen_attention_ref])
@torch.no_grad()
def test_tower_matches_transformers(reference, attention_fn):
    pixels, grid_thw = _pixels(GRIDS), torch.tensor(GRIDS)
    expected = reference.model.visual(pixels, grid_thw)
    embeds, deepstack = _tower(reference, attention_fn=attention_fn)(pixels, grid_thw)
    assert embeds.shape == (sum(merged_token_counts(GRIDS, 2)), 48)  # 6 + 8 tokens
    torch.testing.assert_close(embeds, expected.pooler_output, atol=1e-4, rtol=1e-4)
    expected_deepstack = getattr(expected, "deepstack_features", None) or []
    num_deepstack = 2 if isinstance(reference, Qwen3VLForConditionalGeneration) else 0
    assert len(deepstack) == len(expected_deepstack) == num_deepstack
    for ours, theirs in zip(deepstack, expected_deepstack, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_images_do_not_attend_to_each_other(reference):
    tower = _tower(reference)
    pixels = _pixels(GRIDS)
    together, _ = tower(pixels, GRIDS)
    first, _ = tower(pixels[:24], GRIDS[:1])
    second, _ = tower(pixels[24:], GRIDS[1:])
    torch.testing.assert_close(together, torch.cat([first, second]), atol=1e-5, rtol=1e-5)


def test_varlen_attention_matches_ref():
    q, k, v = torch.randn(3, 20, 2, 8, generator=torch.Generator().manual_seed(2)).unbind(0)
    bounds = [0, 5, 12, 20]
    torch.testing.assert_close(
        varlen_attention(q, k, v, bounds, 0.3), varlen_attention_ref(q, k, v, bounds, 0.3)
    )


def test_load_weights_names_missing_and_unexpected(reference):
    tower = Qwen3_5VisionTower(reference.config.vision_config)
    weights = dict(reference.model.visual.state_dict())
    weights.pop("blocks.1.attn.qkv.bias")
    with pytest.raises(ValueError, match=r"missing.*blocks\.1\.attn\.qkv\.bias"):
        tower.load_weights(weights.items())
    extra = {**reference.model.visual.state_dict(), "blocks.9.attn.qkv.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected.*blocks\.9\.attn\.qkv\.weight"):
        tower.load_weights(extra.items())


def test_bad_pixel_shape_is_a_value_error(reference):
    tower = Qwen3_5VisionTower(reference.config.vision_config)
    with pytest.raises(ValueError, match="pixel_values shape"):
        tower(_pixels([[1, 4, 4]]), GRIDS)
    with pytest.raises(ValueError, match="multiples of 2"):
        tower(_pixels([[1, 3, 4]]), [[1, 3, 4]])


def _image(grid):
    return [START] + [IMAGE] * merged_token_counts([grid], 2)[0] + [END]


PROMPTS = {
    "no_image": ([1, 2, 3, 4, 5], []),
    "one_image": ([1, 2, *_image(GRIDS[0]), 3, 4], GRIDS[:1]),
    "two_images_text_between": ([1, *_image(GRIDS[0]), 5, 6, 7, *_image(GRIDS[1]), 8], GRIDS),
    "image_in_second_turn": ([1, 2, 3, 4, 5, 6, 7, 8, *_image([1, 2, 10]), 9], [[1, 2, 10]]),
    "image_first": ([*_image(GRIDS[1]), 3], GRIDS[1:]),
}


@pytest.mark.parametrize("case", PROMPTS)
def test_mrope_matches_get_rope_index(reference, case):
    token_ids, grids = PROMPTS[case]
    input_ids = torch.tensor([token_ids])
    expected, expected_delta = reference.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    positions, delta = mrope_positions(token_ids, grids, 2, IMAGE, START)
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)
    # Decode continues on all three rows at index + delta.
    first_decode = mrope_text_positions(len(token_ids), 2, delta)[:, 0]
    assert first_decode.tolist() == [int(positions.max()) + 1] * 3


def test_mrope_rejects_placeholder_mismatch():
    short = [1, START, *[IMAGE] * 5, END]
    with pytest.raises(ValueError, match="exactly 6 image tokens"):
        mrope_positions(short, GRIDS[:1], 2, IMAGE, START)
    with pytest.raises(ValueError, match="1 images but 2 image grids"):
        mrope_positions([1, *_image(GRIDS[0])], GRIDS, 2, IMAGE, START)
    with pytest.raises(ValueError, match="outside"):
        mrope_positions([1, IMAGE, *_image(GRIDS[0])], GRIDS[:1], 2, IMAGE, START)
