"""The HTTP process's tokenizer load (`axon.tokenizer.auto_class`): the class AutoTokenizer picks,
recorded on the first load, gives on every later load a tokenizer identical to AutoTokenizer's
(class, Rust tokenizer, ids, decoding, chat template), without importing torch."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from axon.cache_dir import MANIFEST
from axon.tokenizer.auto_class import CLASS_FILE, KIND, class_key, load_auto_tokenizer
from tests.server.conftest import write_tokenizer

TEXTS = ("hello world w17 w200", "tell me a story <|im_end|> w3", "  unknown  words\n")
MESSAGES = [
    {"role": "system", "content": "tell me"},
    {"role": "user", "content": "hello world w42"},
]
# qwen2 and qwen3_5: AutoTokenizer swaps in the model's own class for the saved one.
MODEL_TYPES = ("qwen3", "qwen2", "qwen3_5", "llama", "gemma3_text")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / KIND


def _model_dir(path: Path, model_type: str) -> Path:
    """A checkpoint directory's tokenizer files: the tiny chat tokenizer (ChatML template) and a
    config.json of `model_type` (no weights: the tokenizer load never reads them)."""
    path.mkdir(parents=True)
    write_tokenizer(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def _assert_identical(tokenizer, reference) -> None:
    assert type(tokenizer) is type(reference)
    assert tokenizer.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert tokenizer.all_special_tokens == reference.all_special_tokens
    assert tokenizer.eos_token_id == reference.eos_token_id
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids) == reference.decode(ids)
    for tokenize in (False, True):
        rendered = reference.apply_chat_template(
            MESSAGES, tokenize=tokenize, add_generation_prompt=True
        )
        assert (
            tokenizer.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True)
            == rendered
        )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_first_and_repeat_loads_equal_autotokenizer(tmp_path, cache, model_type):
    from transformers import AutoTokenizer

    path = str(_model_dir(tmp_path / "model", model_type))
    reference = AutoTokenizer.from_pretrained(path)
    _assert_identical(load_auto_tokenizer(path), reference)  # the miss: AutoTokenizer's own
    entry = cache / class_key(path)
    recorded = json.loads((entry / CLASS_FILE).read_text())
    assert recorded == {"module": type(reference).__module__, "name": type(reference).__name__}
    _assert_identical(load_auto_tokenizer(path), reference)  # the hit: the recorded class


def test_a_repeat_load_imports_no_torch(tmp_path, cache):
    """What the change is for: the HTTP process (a fresh interpreter here) stays free of torch."""
    path = str(_model_dir(tmp_path / "model", "qwen3"))
    load_auto_tokenizer(path)
    script = (
        "import sys; from axon.tokenizer.loading import load_tokenizer; "
        f"t = load_tokenizer({path!r}); "
        "print(type(t).__name__, t('hello w17')['input_ids'], 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out == ["TokenizersBackend", "[7,", "17]", "False"]


def test_an_edited_tokenizer_config_is_a_new_key(tmp_path):
    path = _model_dir(tmp_path / "model", "qwen3")
    before = class_key(str(path))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "X"}))
    assert class_key(str(path)) != before
    assert class_key("Qwen/Qwen3-0.6B") is None  # not a directory: AutoTokenizer every time


def test_an_entry_naming_a_missing_class_falls_back_and_is_discarded(tmp_path, cache):
    """A verified entry whose class this transformers lacks (e.g. after an upgrade that kept
    the version string): AutoTokenizer's tokenizer, and the entry is rebuilt on the next load."""
    from transformers import AutoTokenizer

    path = str(_model_dir(tmp_path / "model", "qwen2"))
    load_auto_tokenizer(path)
    entry = cache / class_key(path)
    missing = {"module": "transformers.models.qwen2.tokenization_qwen2", "name": "Gone"}
    (entry / CLASS_FILE).write_text(json.dumps(missing))
    digest = hashlib.sha256((entry / CLASS_FILE).read_bytes()).hexdigest()
    (entry / MANIFEST).write_text(json.dumps({"files": {CLASS_FILE: digest}}))
    _assert_identical(load_auto_tokenizer(path), AutoTokenizer.from_pretrained(path))
    assert not entry.exists()
    load_auto_tokenizer(path)
    assert json.loads((entry / CLASS_FILE).read_text())["name"] == "Qwen2Tokenizer"


def test_an_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    path = str(_model_dir(tmp_path / "model", "qwen2"))
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path / "not-a-dir"))
    _assert_identical(load_auto_tokenizer(path), AutoTokenizer.from_pretrained(path))
