"""benchmarks/activation_quality.py's own parts: every position's logits from axon's engine equal
transformers' (on a tiny gemma3, through the real scheduler and runner), the KL / top-1
figures on known distributions, and the prose filter on a Language Reference topic."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from axon import LLM

from .tiny_models import engine_kwargs, get_tiny_model, random_prompt

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ATOL = 1e-4  # fp32, as tests/model/test_logits.py


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("activation_quality")
    finally:
        sys.path.remove(str(BENCH))


def test_every_position_logits_equal_transformers(bench, tiny_model_root):
    # 21 tokens: past gemma3's sliding window of 8, over two blocks of 16
    tiny = get_tiny_model("gemma3_text", tiny_model_root)
    llm = LLM(**engine_kwargs(tiny))
    prompt = random_prompt(21, seed=5)

    got = bench.all_position_logits(llm, prompt)
    with torch.no_grad():
        want = tiny.hf_model(torch.tensor([prompt])).logits[0].float()  # [T, V]

    assert got.shape == tuple(want.shape)
    assert float(np.abs(got - want.numpy()).max()) <= ATOL
    assert not llm.engine.has_unfinished()  # the window's sequence is gone, its blocks freed
    again = bench.all_position_logits(llm, prompt)  # and a second window runs the same
    assert float(np.abs(again - got).max()) <= ATOL


def test_score_figures_on_known_distributions(bench, tmp_path):
    exact = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]], np.float32))
    int8 = exact + 3.0  # a constant shift: the same distributions
    llamacpp = np.log(np.array([[0.5, 0.25, 0.25], [0.6, 0.3, 0.1]], np.float32))
    paths = {}
    for name, logits in (("exact", exact), ("int8", int8), ("llamacpp", llamacpp)):
        np.save(tmp_path / f"{name}.npy", logits)
        paths[name] = [tmp_path / f"{name}.npy"]
    windows = [[0, 0, 1]]  # targets 0 then 1

    pairs, perplexity = bench.score(paths, windows)

    by_pair = {(p["reference"], p["other"]): p for p in pairs}
    assert list(by_pair) == [("exact", "int8"), ("exact", "llamacpp"), ("int8", "llamacpp")]
    same = by_pair["exact", "int8"]
    assert same["top1_agreement"] == 1.0 and same["kl_max"] == pytest.approx(0.0, abs=1e-7)
    kl_second = 0.1 * math.log(0.1 / 0.6) + 0.8 * math.log(0.8 / 0.3)
    for pair in (("exact", "llamacpp"), ("int8", "llamacpp")):
        got = by_pair[pair]
        assert got["positions"] == 2 and got["top1_agreement"] == 0.5
        assert got["kl_max"] == pytest.approx(kl_second, rel=1e-5)
        assert got["kl_mean"] == pytest.approx(kl_second / 2, rel=1e-5)
    want = math.exp(-(math.log(0.5) + math.log(0.8)) / 2)  # probabilities 0.5 and 0.8
    assert perplexity["exact"] == pytest.approx(want, rel=1e-5)
    assert perplexity["int8"] == pytest.approx(want, rel=1e-5)
    assert perplexity["llamacpp"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.3)) / 2))


def test_prose_paragraphs_keep_sentences_only(bench):
    topic = (
        "Title\n*****\n\n\nSection\n=======\n\nThis is a sentence of real prose that the "
        "filter\nkeeps, joined onto one line.\n\n   for x in range(3):\n       print(x)\n\n"
        "Short fragment here.\n"
    )
    assert bench.prose_paragraphs(topic) == [
        "This is a sentence of real prose that the filter keeps, joined onto one line."
    ]
