"""A tiny random Qwen3 whose byte-level tokenizer can spell any text and has the marker tokens
(`<think>`, `</think>`, `<tool_call>`, `</tool_call>`), and an `axon serve` running it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llama_cpp_sdist import extract_llama_cpp
from tests.server.conftest import start_server, stop_server
from tiny_configs import BYTE_QWEN3

MODEL_ID = "tiny-qwen3"  # the name start_server serves
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
EOS_ID = BYTE_QWEN3["eos_token_id"]  # <|im_end|>: the 256 bytes, then SPECIALS
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools>\nCall a tool as <tool_call>{json}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def byte_tokenizer(markers_special: bool = False):
    """Byte-level BPE without merges: one token per byte, plus the special and marker tokens
    (the markers flagged special or not: published Qwen tokenizers leave them unflagged, others
    flag them, and the output must be the same either way)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    markers = [AddedToken(m, special=markers_special, normalized=False) for m in MARKERS]
    tokenizer.add_tokens(markers, special_tokens=markers_special)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_byte_model(path: Path, markers_special: bool = False) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**BYTE_QWEN3)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    byte_tokenizer(markers_special).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_model(tmp_path_factory.mktemp("tiny_byte_qwen3"))


@pytest.fixture(scope="session")
def special_markers_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model, its tokenizer flagging `<think>`, `<tool_call>` ... special."""
    return write_byte_model(tmp_path_factory.mktemp("tiny_byte_qwen3_special"), True)


@pytest.fixture(scope="session")
def byte_server(byte_model: Path):
    running = start_server(byte_model)
    yield running
    stop_server(running)


@pytest.fixture()
def byte_client(byte_server):
    from openai import OpenAI

    with OpenAI(base_url=byte_server.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def byte_model_with_corpus_template(path: Path, template: str) -> Path:
    """The byte-level tiny Qwen3 at `path` carrying `template` (a file of llama.cpp's template
    corpus) as its chat template: real templates on a model that decodes bytes."""
    templates = extract_llama_cpp(
        "models/templates/", lambda rest: rest.endswith(".jinja"), suffix="-templates"
    )
    model = write_byte_model(path)
    # chat_template.jinja wins over the tokenizer config's template (transformers' precedence).
    shutil.copyfile(templates / template, Path(model) / "chat_template.jinja")
    return model
