"""Qwen3-VL images through the offline engine (`axon.LLM`) against transformers.

A tiny random `Qwen3VLForConditionalGeneration` written by transformers: a three-layer Qwen3
text stack with interleaved M-RoPE, a three-block tower whose blocks 0 and 2 feed DeepStack (so
LM layers 0 and 1 get features, layer 2 none), and a preprocessor_config.json whose pixel band is
not Qwen's default. The reference is transformers' forward / `generate` on the expanded prompt
with the same pixel_values / image_grid_thw.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import GenerationConfig, Qwen3VLConfig
from transformers import Qwen3VLForConditionalGeneration as HFQwen3VL

from axon import LLM, SamplingParams
from axon.models.qwen3_vl import Qwen3VLForConditionalGeneration
from axon.multimodal.placeholders import expand_image_placeholders
from axon.multimodal.processor import ImageProcessor, ProcessorConfig
from tiny_configs import PAD_ID, PREPROCESSOR, QWEN3_VL_TEXT, QWEN3_VL_VISION

from .tiny_models import TinyModel, write_checkpoint

IMAGE, VIDEO, START, END = 380, 381, 382, 383
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    torch.manual_seed(77)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START) | dict(
        vision_end_token_id=END
    )
    config = Qwen3VLConfig(text_config=QWEN3_VL_TEXT, vision_config=QWEN3_VL_VISION, **ids)
    config._attn_implementation = "eager"
    model = HFQwen3VL(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
            elif name.startswith("model.visual."):  # init leaves the tower near-constant
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    path = write_checkpoint(model, tmp_path_factory.mktemp("qwen3_vl") / "vl")
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return TinyModel(arch="qwen3_vl", path=path, hf_model=model)


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


IMAGES = [_image(1, 30, 45), _image(2, 50, 20), _image(3, 40, 40)]


def _prompt(*parts) -> list[int]:
    """Token ids: ints are text runs (that many random tokens), None an image placeholder."""
    ids = []
    for index, part in enumerate(parts):
        text = np.random.default_rng(index).integers(3, 370, part or 0).tolist()
        ids += [START, IMAGE, END] if part is None else text
    return ids


CASES = {
    "one_image": (_prompt(5, None, 7), IMAGES[:1]),
    "two_images": (_prompt(4, None, 6, None, 3), IMAGES[:2]),
    # A first user turn and the answer in text, the image in the second user turn.
    "second_turn": (_prompt(9, 11, 3, None, 5), IMAGES[2:]),
    "text_only": (_prompt(20), []),
}


def _hf_inputs(ids: list[int], images: list[Image.Image]) -> dict:
    """transformers' inputs for the prompt `ids` with its placeholders expanded."""
    processor = ImageProcessor(ProcessorConfig.from_dict(PREPROCESSOR))
    processed = [processor(image) for image in images]
    ids = expand_image_placeholders(ids, [p.num_tokens for p in processed], IMAGE)
    input_ids = torch.tensor([ids])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if processed:
        pixels = np.concatenate([p.pixel_values for p in processed])
        inputs["pixel_values"] = torch.from_numpy(pixels)
        inputs["image_grid_thw"] = torch.tensor([p.grid_thw for p in processed])
        inputs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    return inputs


@torch.no_grad()
def _reference(tiny: TinyModel, ids: list[int], images: list[Image.Image]) -> list[int]:
    """transformers' greedy continuation (never stopping at EOS) of the expanded prompt."""
    inputs = _hf_inputs(ids, images)
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=PAD_ID)
    out = tiny.hf_model.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@torch.no_grad()
def _reference_logits(tiny: TinyModel, ids: list[int], images: list[Image.Image]):
    return tiny.hf_model(**_hf_inputs(ids, images)).logits[0, -1]


def _request(ids: list[int], images: list[Image.Image]) -> dict:
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def _llm(tiny: TinyModel, **overrides) -> LLM:
    kv_per_token = (
        2 * QWEN3_VL_TEXT["num_hidden_layers"] * QWEN3_VL_TEXT["num_key_value_heads"] * 16 * 4
    )
    kwargs = dict(
        model=str(tiny.path),
        dtype="float32",
        block_size=16,
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_memory=256 * 16 * kv_per_token,
    )
    return LLM(**{**kwargs, **overrides})


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return _llm(tiny)


def _last_logits(llm: LLM, ids: list[int], images: list[Image.Image]) -> torch.Tensor:
    """The engine's logits [V] at the prompt's last position (through the engine's logits
    capture hook, as `LLM.compute_logits` does for text prompts)."""
    engine = llm.engine
    ids, inputs = llm._images(ids, {"image": images})
    engine._captured_logits = {}
    try:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        (seq,) = engine.add_request("logits", ids, params, images=inputs)
        while not seq.is_finished:
            engine.step()
        return engine._captured_logits[seq.seq_id].cpu()
    finally:
        engine._captured_logits = None


def test_logits_match_transformers_and_need_deepstack(tiny, llm):
    assert isinstance(llm.engine.runner.model, Qwen3VLForConditionalGeneration)
    for name in ("one_image", "two_images"):
        ids, images = CASES[name]
        expected = _reference_logits(tiny, ids, images)
        torch.testing.assert_close(_last_logits(llm, ids, images), expected, atol=1e-4, rtol=0)
    # The check above is sensitive to DeepStack: transformers without it is far off.
    visual = tiny.hf_model.model.visual
    indexes, visual.deepstack_visual_indexes = visual.deepstack_visual_indexes, []
    try:
        without = _reference_logits(tiny, *CASES["one_image"])
    finally:
        visual.deepstack_visual_indexes = indexes
    assert (without - _reference_logits(tiny, *CASES["one_image"])).abs().max() > 1e-2


def _image_cut_by_chunk(ids: list[int], images, budget: int) -> bool:
    """Whether a chunk boundary (a multiple of `budget`, one sequence alone) falls strictly
    inside an image's placeholder run of the expanded prompt."""
    ids = _hf_inputs(ids, images)["input_ids"][0].tolist()
    rows = [index for index, token in enumerate(ids) if token == IMAGE]
    return any(row % budget == 0 and row - 1 in rows for row in rows)


@pytest.mark.parametrize("budget", [2048, 5], ids=["one_chunk", "chunk_cuts_images"])
def test_greedy_matches_transformers(tiny, budget):
    llm = _llm(tiny, max_num_batched_tokens=budget, enable_prefix_caching=False)
    for name in ("one_image", "two_images", "second_turn"):
        ids, images = CASES[name]
        assert _image_cut_by_chunk(ids, images, budget) == (budget == 5), name
        (out,) = llm.generate([_request(ids, images)], GREEDY)
        assert out.outputs[0].token_ids == _reference(tiny, ids, images), name


def test_batch_mixing_text_and_images_equals_each_alone(tiny, llm):
    names = ["text_only", "one_image", "two_images", "second_turn"]
    alone = [llm.generate([_request(*CASES[n])], GREEDY)[0].outputs[0].token_ids for n in names]
    llm.engine.reset_prefix_cache()
    together = llm.generate([_request(*CASES[n]) for n in names], GREEDY)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert alone[0] == _reference(tiny, *CASES["text_only"])


def test_text_only_load_skips_the_tower(tiny):
    text_only = _llm(tiny, enable_vision=False)
    model = text_only.engine.runner.model
    assert model.visual is None
    assert not any(name.startswith("visual.") for name, _ in model.named_parameters())
    ids, images = CASES["one_image"]
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate([_request(ids, images)], GREEDY)
    text_ids, _ = CASES["text_only"]
    (out,) = text_only.generate([_request(text_ids, [])], GREEDY)
    assert out.outputs[0].token_ids == _reference(tiny, text_ids, [])
