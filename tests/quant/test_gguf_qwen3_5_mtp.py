"""A `qwen35` GGUF file that carries the MTP block (llama.cpp's converter without `--no-mtp`
appends it as a `nextn` block) drafts as the safetensors checkpoint it was converted from.

The checkpoint is the tiny random Qwen3.5 of test_gguf_qwen3_5.py (the real vocabulary, which
the converter insists on) plus an `mtp.*` block; f32, so both loads compute the same numbers
(up to the tiled value heads' summation order), and so the same drafts, token for token.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from axon import LLM, SamplingParams
from axon.loader.gguf import iterate_gguf_file
from axon.loader.gguf_config import gguf_config_kwargs
from axon.loader.gguf_reader import BulkGGUFReader
from llama_cpp_sdist import CACHE, cache_lock
from model.qwen3_5_mtp_tiny import build_reference
from model.qwen3_5_tiny import qwen3_5_engine_kwargs
from model.tiny_models import TinyModel, random_prompts
from quant.test_gguf_qwen3_5 import converter, real_vocab_qwen3_5  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # a converter run and a real vocabulary
MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen3_5_tokenizer) -> TinyModel:
    tokenizer = qwen3_5_tokenizer
    model = real_vocab_qwen3_5(tokenizer)
    path = tmp_path_factory.mktemp("qwen35-mtp")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    file = path / "model.safetensors"
    tensors = {**load_file(str(file)), **build_reference(model).checkpoint_tensors()}
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return TinyModel("qwen3_5_text", path, model)


@pytest.fixture(scope="module")
def mtp_gguf(converter: Path, checkpoint: TinyModel) -> Path:  # noqa: F811
    key = hashlib.sha256(str(converter.parent).encode())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        key.update((checkpoint.path / name).read_bytes())
    file = CACHE / "qwen35-mtp-gguf" / key.hexdigest()[:16] / "f32.gguf"
    with cache_lock("qwen35-mtp-gguf"):
        if not file.is_file():
            file.parent.mkdir(parents=True, exist_ok=True)
            partial = file.with_suffix(".part")
            command = [sys.executable, str(converter), str(checkpoint.path), "--outtype", "f32"]
            run = subprocess.run(
                [*command, "--outfile", str(partial)], capture_output=True, timeout=600
            )
            assert run.returncode == 0, run.stdout.decode()[-2000:] + run.stderr.decode()[-2000:]
            os.replace(partial, file)
    return file


def _engine(checkpoint: TinyModel, model: Path) -> LLM:
    kwargs = qwen3_5_engine_kwargs(checkpoint, block_size=4, max_num_batched_tokens=16)
    kwargs.update(model=str(model), activation_precision="float32", max_num_seqs=4)
    kwargs["kv_cache_memory"] *= 2
    return LLM(**kwargs, speculative_config=MTP)


def _drafts(llm: LLM, prompts) -> tuple[list, list]:
    """(the greedy tokens, every (tokens, drafts) the MTP drafter proposed)."""
    drafter = llm.engine.speculator.drafter
    propose, calls = drafter.propose, []

    def recording(seqs, max_tokens):
        drafts = propose(seqs, max_tokens)
        calls.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts) if d)
        return drafts

    drafter.propose = recording
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs], calls


def test_the_gguf_nextn_block_loads_as_mtp(mtp_gguf, checkpoint):
    reader = BulkGGUFReader(str(mtp_gguf))
    model_type, kwargs = gguf_config_kwargs(reader)
    assert (model_type, kwargs["mtp_num_hidden_layers"]) == ("qwen3_5_text", 1)
    assert kwargs["num_hidden_layers"] == checkpoint.config.num_hidden_layers
    names = {name for name, _ in iterate_gguf_file(str(mtp_gguf), with_mtp=True)}
    mtp_names = {name for name in load_file(str(checkpoint.path / "model.safetensors"))}
    assert {n for n in names if n.startswith("mtp.")} == {
        n for n in mtp_names if n.startswith("mtp.")
    }
    assert not any(n.startswith("mtp.") for n, _ in iterate_gguf_file(str(mtp_gguf)))


def test_gguf_mtp_drafts_as_the_safetensors_model(mtp_gguf, checkpoint):
    prompts = random_prompts((6, 21), seed=8)
    tokens, calls = _drafts(_engine(checkpoint, checkpoint.path), prompts)
    gguf_tokens, gguf_calls = _drafts(_engine(checkpoint, mtp_gguf), prompts)
    assert gguf_tokens == tokens
    assert calls and gguf_calls == calls
