"""GGUF weights stay in the mapped file: the quantized blocks the kernels read are views of the
file's mapping (no copy at load), they keep it mapped after the reader is dropped, and the
engine's output is bit-identical to an engine that copied them out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM
from axon.layers.quantized import QuantizedEmbedding, QuantizedMatmul
from axon.loader import gguf as gguf_loader
from model.tiny_models import random_prompts
from quant.gguf_files import build_gguf_model, write_gguf


def _mappings_of(path: Path) -> list[tuple[int, int]]:
    """[start, end) address ranges at which this process maps `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _quantized_buffers(llm: LLM) -> list[torch.Tensor]:
    kinds = (QuantizedMatmul, QuantizedEmbedding)
    modules = [m for m in llm.engine.runner.model.modules() if isinstance(m, kinds)]
    return [m.raw for m in modules if getattr(m, "raw", None) is not None]


def _engine(path: Path) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zero-copy") / "qwen3-q8_0.gguf"
    write_gguf(build_gguf_model("qwen3"), "qwen3", Q.Q8_0, path)
    return path.resolve()


def test_quantized_weights_are_views_of_the_mapped_file(gguf_file):
    llm = _engine(gguf_file)

    assert gguf_loader.open_gguf.cache_info().currsize == 0  # the reader is gone
    ranges = _mappings_of(gguf_file)
    buffers = _quantized_buffers(llm)
    assert ranges and buffers
    for raw in buffers:
        start, end = raw.data_ptr(), raw.data_ptr() + raw.numel()
        assert any(low <= start and end <= high for low, high in ranges), "a copied weight"


def test_output_equals_an_engine_with_copied_weights(gguf_file, monkeypatch):
    prompts = random_prompts((1, 7, 20), seed=5)
    mapped = _engine(gguf_file).compute_logits(prompts)
    original = gguf_loader.iterate_gguf_file  # what the loader imports when it loads a GGUF
    monkeypatch.setattr(
        gguf_loader, "iterate_gguf_file", lambda path, **kw: original(path, False, **kw)
    )
    copied_llm = _engine(gguf_file)
    ranges = _mappings_of(gguf_file)
    for raw in _quantized_buffers(copied_llm):  # the test tells a copy from a view
        assert not any(low <= raw.data_ptr() < high for low, high in ranges)

    copied = copied_llm.compute_logits(prompts)

    for got, want in zip(mapped, copied):
        assert torch.equal(got, want)
