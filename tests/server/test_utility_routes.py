"""vLLM's utility routes against the session's `axon serve`: /tokenize (a prompt, or chat messages
through the chat template), /detokenize, /version, and GET /v1/models/{id}."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

import axon

from .conftest import MAX_MODEL_LEN, MODEL_ID, WORDS

HELLO = [{"role": "user", "content": "hello world"}]
HELLO_ID, WORLD_ID = 3 + WORDS.index("hello"), 3 + WORDS.index("world")  # after 3 specials


def test_tokenize_a_prompt(http):
    reply = http.post("/tokenize", json={"model": MODEL_ID, "prompt": "hello world"})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "count": 2,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": [HELLO_ID, WORLD_ID],
        "token_strs": None,
    }


def test_tokenize_messages_counts_what_chat_bills(http, client):
    reply = http.post("/tokenize", json={"messages": HELLO, "return_token_strs": True}).json()
    chat = client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=1)
    assert reply["count"] == len(reply["tokens"]) == chat.usage.prompt_tokens
    assert reply["token_strs"][:4] == ["<|im_start|>", "user", "hello", "world"]
    assert reply["token_strs"][-1] == "assistant"
    bare = http.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": False}).json()
    assert bare["tokens"] == reply["tokens"][:-2]  # without `<|im_start|> assistant`


def test_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "tell me a story"}).json()["tokens"]
    reply = http.post("/detokenize", json={"model": MODEL_ID, "tokens": tokens})
    assert reply.status_code == 200 and reply.json() == {"prompt": "tell me a story"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "hi", "messages": HELLO}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_unknown_model_is_a_404(http):
    reply = http.post("/tokenize", json={"model": "nope", "prompt": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_version(http):
    assert http.get("/version").json() == {"version": axon.__version__}


def test_retrieve_a_model(http):
    card = http.get(f"/v1/models/{MODEL_ID}").json()
    assert card["id"] == MODEL_ID and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["type"] == "not_found_error" and error["code"] == "model_not_found"


def test_add_special_tokens_and_the_only_model_default():
    """A tokenizer that adds a BOS: a prompt gets it unless asked not to; messages (whose
    template writes its own special tokens) only when asked; `model` may be left out while one
    model is served, not while two are."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from axon.server.app import create_app

    from .conftest import write_tokenizer

    tokenizer = _bos_tokenizer(write_tokenizer, PreTrainedTokenizerFast, TemplateProcessing)
    model = SimpleNamespace(
        id=MODEL_ID,
        max_model_len=64,
        tokenizer=tokenizer,
        vocab_size=len(tokenizer),
        encode=lambda text, add_special_tokens=True: tokenizer.encode(
            text, add_special_tokens=add_special_tokens
        ),
        render_chat=lambda messages, *args: "hello world",
    )
    models = [model]
    registry = SimpleNamespace(list_models=lambda: models)
    app = create_app(SimpleNamespace(config=SimpleNamespace(api_key=None), registry=registry))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            replies = [
                await http.post("/tokenize", json=body)
                for body in (
                    {"prompt": "hello"},
                    {"prompt": "hello", "add_special_tokens": False},
                    {"messages": HELLO},
                    {"messages": HELLO, "add_special_tokens": True},
                )
            ]
            models.append(model)
            return [*replies, await http.post("/tokenize", json={"prompt": "hello"})]

    *replies, ambiguous = asyncio.run(scenario())
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokens = [reply.json()["tokens"] for reply in replies]
    assert tokens == [[bos, HELLO_ID], [HELLO_ID], [HELLO_ID, WORLD_ID], [bos, HELLO_ID, WORLD_ID]]
    assert ambiguous.status_code == 400 and ambiguous.json()["error"]["param"] == "model"


def _bos_tokenizer(write_tokenizer, tokenizer_class, template_processing):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer(Path(directory))
        tokenizer = tokenizer_class.from_pretrained(directory)
    bos = ("<|endoftext|>", tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    processor = template_processing(single="<|endoftext|> $A", special_tokens=[bos])
    tokenizer.backend_tokenizer.post_processor = processor
    return tokenizer


def test_tokenize_continues_the_final_message(http, client):
    partial = [*HELLO, {"role": "assistant", "content": "hello"}]
    body = {"messages": partial, "continue_final_message": True, "return_token_strs": True}
    reply = http.post("/tokenize", json=body).json()
    assert reply["token_strs"][-3:] == ["<|im_start|>", "assistant", "hello"]
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=partial,
        max_tokens=1,
        extra_body={"continue_final_message": True},
    )
    assert chat.usage.prompt_tokens == reply["count"]


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(http):
    """What lm-eval's RemoteTokenizer reads: eos/bos strings (their ids by /tokenize without
    special tokens), the chat template it renders itself, /detokenize for its batch_decode."""
    import jinja2

    info = http.get("/tokenizer_info").json()
    # the fast tokenizer's class: transformers 5 renamed it
    assert info["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert (info["eos_token"], info["pad_token"], info["bos_token"]) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["added_tokens_decoder"]["1"] == "<|im_start|>"
    assert not {"tokenizer_file", "vocab_file", "name_or_path"} & set(info)
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]
    rendered = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(messages=HELLO, add_generation_prompt=True)
    )
    served = http.post("/tokenize", json={"messages": HELLO, "return_token_strs": True}).json()
    again = http.post("/tokenize", json={"prompt": rendered, "add_special_tokens": False})
    assert again.json()["tokens"] == served["tokens"]
    assert http.get("/tokenizer_info", params={"model": MODEL_ID}).json() == info
    assert http.get("/tokenizer_info", params={"model": "nope"}).status_code == 404
