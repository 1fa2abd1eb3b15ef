"""Vision under tensor parallelism: every rank holds the whole vision tower and runs it on the
same pixels (sent once per request, never the tower's output), so TP=2 greedy tokens equal
TP=1's for a tiny Qwen3.5 with images, with chunks that cut through the images. Its own module:
one process holds one tensor-parallel group at a time."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from axon import LLM
from axon.runner.tensor_parallel import image_sources
from axon.sequence import ImageInputs
from tests.model.qwen3_5_tiny import _perturb, qwen3_5_engine_kwargs, write_qwen3_5
from tests.model.test_qwen3_5_images import CASES, END, GREEDY, IMAGE, START
from tests.model.test_qwen3_5_images import _request as image_request
from tests.model.tiny_models import TinyModel
from tiny_configs import PREPROCESSOR, QWEN3_5_IMAGES_TEXT, QWEN3_5_VISION

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> TinyModel:
    """The image tests' tiny Qwen3.5 (a perturbed tower, image ids inside the vocabulary)."""
    torch.manual_seed(99)
    ids = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
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
    path = write_qwen3_5(model, tmp_path_factory.mktemp("tp_vision") / "vl")
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return TinyModel(arch="qwen3_5", path=path, hf_model=model)


@pytest.mark.parametrize("budget", [2048, 5], ids=["one_chunk", "chunk_cuts_images"])
def test_tp2_greedy_with_images_equals_tp1(vl, budget):
    kwargs = qwen3_5_engine_kwargs(vl, max_num_batched_tokens=budget)
    requests = [image_request(*CASES[name]) for name in ("one_image", "two_images", "text_only")]
    want = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(requests, GREEDY)]
    pair = LLM(**kwargs, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in pair.generate(requests, GREEDY)]
        assert pair.engine.runner.workers.images_sent == set()  # every request's images done
    finally:
        pair.engine.close()
    assert got == want


def test_pixels_travel_once_per_request():
    images = ImageInputs("pixels", [(1, 4, 4)], [(2, 4)], [b"h"], None, 0)
    sent: set[int] = set()
    first = image_sources([(images, slice(0, 3))], sent)
    rest = image_sources([(images, slice(3, 4))], sent)
    assert [(pixels, start, stop, last) for _, pixels, start, stop, last in first] == [
        (("pixels", [(1, 4, 4)]), 0, 3, False)
    ]
    assert [(pixels, start, stop, last) for _, pixels, start, stop, last in rest] == [
        (None, 3, 4, True)
    ]
    assert first[0][0] == rest[0][0] and sent == set()
