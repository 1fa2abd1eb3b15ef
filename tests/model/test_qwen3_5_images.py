"""Images through the offline engine (`axon.LLM`) against transformers' Qwen3.5.

A tiny random `Qwen3_5ForConditionalGeneration` (the text stack of qwen3_5_tiny, a perturbed
vision tower, image token ids inside the tiny vocabulary) and a preprocessor_config.json whose
pixel band is not Qwen's default. The reference is transformers' `generate` on the expanded
prompt with the same pixel_values / image_grid_thw.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from axon import LLM, SamplingParams
from axon.config import EngineConfig
from axon.engine.client import EngineClient
from axon.multimodal.placeholders import expand_image_placeholders
from axon.multimodal.processor import ImageProcessor, ProcessorConfig
from tiny_configs import PREPROCESSOR, QWEN3_5_IMAGES_TEXT, QWEN3_5_VISION

from .qwen3_5_tiny import _perturb, qwen3_5_engine_kwargs, write_qwen3_5
from .tiny_models import PAD_ID, TinyModel

IMAGE, VIDEO, START, END = 380, 381, 382, 383
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    torch.manual_seed(99)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START) | dict(
        vision_end_token_id=END
    )
    config = Qwen3_5Config(
        text_config=QWEN3_5_IMAGES_TEXT,
        vision_config=QWEN3_5_VISION,
        tie_word_embeddings=False,
        **ids,
    )
    config._attn_implementation = "eager"
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(5))
    with torch.no_grad():
        for param in model.model.visual.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    path = write_qwen3_5(model, tmp_path_factory.mktemp("qwen3_5_images") / "vl")
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return TinyModel(arch="qwen3_5", path=path, hf_model=model)


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


IMAGES = [_image(1, 30, 45), _image(2, 50, 20), _image(3, 30, 45)]  # 0 and 2: same size


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 370, n).tolist()


def _prompt(*parts) -> list[int]:
    """Token ids: ints are text runs (that many random tokens), None an image placeholder."""
    ids = []
    for index, part in enumerate(parts):
        ids += [START, IMAGE, END] if part is None else _text(index, part)
    return ids


def _reference(tiny: TinyModel, ids: list[int], images: list[Image.Image]) -> list[int]:
    """transformers' greedy continuation (never stopping at EOS) of the expanded prompt."""
    processor = ImageProcessor(ProcessorConfig.from_dict(PREPROCESSOR))
    processed = [processor(image) for image in images]
    ids = expand_image_placeholders(ids, [p.num_tokens for p in processed], IMAGE)
    input_ids = torch.tensor([ids])
    kwargs = {}
    if processed:
        kwargs["pixel_values"] = torch.from_numpy(
            np.concatenate([p.pixel_values for p in processed])
        )
        kwargs["image_grid_thw"] = torch.tensor([p.grid_thw for p in processed])
        kwargs["mm_token_type_ids"] = (input_ids == IMAGE).int()
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=PAD_ID)
    out = tiny.hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=config,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


def _request(ids: list[int], images: list[Image.Image]) -> dict:
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def _llm(tiny: TinyModel, **overrides) -> LLM:
    return LLM(**qwen3_5_engine_kwargs(tiny, **overrides))


CASES = {
    "one_image": (_prompt(5, None, 7), IMAGES[:1]),
    "two_images": (_prompt(4, None, 6, None, 3), IMAGES[:2]),
    "text_only": (_prompt(20), []),
}


@pytest.mark.parametrize("budget", [2048, 5], ids=["one_chunk", "chunk_cuts_images"])
def test_greedy_matches_transformers(tiny, budget):
    llm = _llm(tiny, max_num_batched_tokens=budget, enable_prefix_caching=False)
    for name in ("one_image", "two_images"):
        ids, images = CASES[name]
        (out,) = llm.generate([_request(ids, images)], GREEDY)
        assert out.outputs[0].token_ids == _reference(tiny, ids, images), name


def test_batch_mixing_text_and_images_equals_each_alone(tiny):
    llm = _llm(tiny, max_num_batched_tokens=16)
    names = ["text_only", "one_image", "two_images"]
    alone = [llm.generate([_request(*CASES[n])], GREEDY)[0].outputs[0].token_ids for n in names]
    llm.engine.reset_prefix_cache()
    together = llm.generate([_request(*CASES[n]) for n in names], GREEDY)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert alone[0] == _reference(tiny, *CASES["text_only"])


def test_prefix_cache_keys_blocks_by_image(tiny):
    # Enough state snapshots that block 0's survives the first requests' generated blocks.
    llm = _llm(tiny, block_size=4, num_state_snapshots=64)
    ids = _prompt(6, None, 9)  # the image's tokens start in block 1 (index 7)
    first = llm.generate([_request(ids, [IMAGES[0]])], GREEDY)[0]
    same = llm.generate([_request(ids, [IMAGES[0]])], GREEDY)[0]
    other = llm.generate([_request(ids, [IMAGES[2]])], GREEDY)[0]
    length = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == (length - 1) // 4 * 4  # every full block but the last
    assert other.num_cached_tokens == 4  # only block 0, before the image
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids == _reference(tiny, ids, [IMAGES[2]])
    assert first.outputs[0].token_ids != other.outputs[0].token_ids


def test_greedy_under_preemption(tiny):
    # Too few blocks for the three at once: preempted sequences recompute their images' rows
    # from the kept tower output and M-RoPE positions.
    requests = [CASES["one_image"], CASES["two_images"], (CASES["one_image"][0], IMAGES[2:])]
    llm = _llm(tiny, kv_cache_blocks=6, max_model_len=96, max_num_batched_tokens=16)
    outputs = llm.generate([_request(*request) for request in requests], GREEDY)
    assert llm.get_stats()["num_preemptions"] > 0
    for out, request in zip(outputs, requests):
        assert out.outputs[0].token_ids == _reference(tiny, *request)


def test_n_samples_share_one_tower_run(tiny, monkeypatch):
    llm = _llm(tiny, max_num_batched_tokens=6)
    runs = []
    encode = llm.engine.runner.encode_images
    monkeypatch.setattr(llm.engine.runner, "encode_images", lambda *a: runs.append(1) or encode(*a))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    ids, images = CASES["two_images"]
    (out,) = llm.generate([_request(ids, images)], params)
    expected = _reference(tiny, ids, images)
    assert [sample.token_ids for sample in out.outputs] == [expected, expected]
    assert len(runs) == 1


def test_placeholder_mismatch_and_text_only_load(tiny):
    llm = _llm(tiny)
    ids, images = CASES["one_image"]
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        llm.generate([_request(ids, IMAGES[:2])], GREEDY)
    text_only = _llm(tiny, enable_vision=False)
    assert text_only.engine.runner.model.visual is None
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate([_request(ids, images)], GREEDY)
    text_ids, _ = CASES["text_only"]
    (out,) = text_only.generate([_request(text_ids, [])], GREEDY)
    assert out.outputs[0].token_ids == _reference(tiny, text_ids, [])


def test_encode_image_through_the_engine_process(tiny):
    processed = ImageProcessor(ProcessorConfig.from_dict(PREPROCESSOR))(IMAGES[1])
    pixel_values = torch.from_numpy(processed.pixel_values)
    with torch.no_grad():
        expected = tiny.hf_model.model.visual(pixel_values, torch.tensor([processed.grid_thw]))
    expected = expected.pooler_output

    async def main():
        config = EngineConfig.from_kwargs(**qwen3_5_engine_kwargs(tiny))
        client = await EngineClient.start(config)
        try:
            return await client.call("encode_image", pixel_values, [processed.grid_thw])
        finally:
            await client.shutdown()

    rows = torch.tensor(asyncio.run(main()))
    assert rows.shape == (processed.num_tokens, QWEN3_5_IMAGES_TEXT["hidden_size"])
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)
