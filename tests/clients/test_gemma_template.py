"""The `openai` client's chat loop on a tiny Gemma 3 carrying Gemma 2's real chat template.

Why this template: llama.cpp's corpus has no Gemma 3 template, and Gemma 3's published one writes
the same turns (`<start_of_turn>user` / `<start_of_turn>model`, `<end_of_turn>`) as
`google-gemma-2-2b-it.jinja`, which the corpus has; Gemma 4's templates are covered by
test_template_loops.py. Gemma 2's template refuses what Gemma 2 was not trained on (a system
role, tool turns, roles that do not alternate): those reach the client as a 400 naming the shape,
never a 422, and everything else renders exactly as transformers renders it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from llama_cpp_sdist import extract_llama_cpp
from tests.clients.conftest import CITY_SCHEMA, MODEL_ID, RESULT
from tests.server.conftest import start_server, stop_server

TEMPLATE = "google-gemma-2-2b-it.jinja"
SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY_SCHEMA}}


def _byte_tokenizer():
    """Byte-level BPE without merges (one token per byte) plus Gemma's turn tokens."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token = SPECIALS[:3]
    return tokenizer


def write_tiny_gemma3(path: Path) -> Path:
    """A random two-layer Gemma 3 (sliding and full attention) over the byte tokenizer, with the
    corpus template as its chat_template.jinja; `<end_of_turn>` ends a turn, as in Gemma 3."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = _byte_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    eos = {"eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "bos_token_id": ids["<bos>"]}
    (path / "generation_config.json").write_text(json.dumps(eos))
    tokenizer.save_pretrained(path)
    templates = extract_llama_cpp(
        "models/templates/", lambda rest: rest.endswith(".jinja"), suffix="-templates"
    )
    shutil.copyfile(templates / TEMPLATE, path / "chat_template.jinja")
    return path


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory: pytest.TempPathFactory):
    model = write_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))
    running = start_server(model)
    yield running, model
    stop_server(running)


@pytest.fixture()
def client(gemma_server):
    from openai import OpenAI

    server, _ = gemma_server
    with OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _prompt_ids(server, messages: list[dict]) -> list[int]:
    answer = httpx.post(
        server.base_url + "/tokenize", json={"model": MODEL_ID, "messages": messages}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_multi_turn_chat_renders_as_transformers(gemma_server, client):
    """Two steps, the first answer sent back as the model's turn: 200s, and the prompt axon
    counted is transformers' rendering of the same messages with the same template."""
    from transformers import AutoTokenizer

    server, model = gemma_server
    messages = [{"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, seed=1)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "And then?"})
    second = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4)
    reference = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert reference.startswith("<bos><start_of_turn>user\nHello<end_of_turn>\n")
    assert reference.endswith("<start_of_turn>model\n")
    ids = _prompt_ids(server, messages)
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=60)
    assert text.json()["prompt"] == reference
    assert second.usage.prompt_tokens == len(ids)


def _refusal(client, messages: list[dict], **extra) -> dict:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, **extra)
    return refused.value.response.json()["error"]


def test_system_role_is_a_400_naming_it(client):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    message = _refusal(client, messages)["message"]
    assert "cannot render this conversation (a system message)" in message
    assert "System role not supported" in message


def test_tool_loop_is_refused_by_name(client):
    """Gemma 2's template has no tool-call format: a forced call is a 400 on `tool_choice`, and
    a history with tool turns (as a client that called the tool itself sends it) a 400 naming
    the turns the template cannot render. Tools alone render (the template ignores them)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    error = _refusal(client, ask, tools=[WEATHER], tool_choice=forced)
    assert error["param"] == "tool_choice"
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=ask, tools=[WEATHER], max_tokens=4
    )
    assert plain.choices[0].finish_reason in ("stop", "length")
    arguments = json.dumps({"city": "Paris"})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    history = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    message = _refusal(client, history, tools=[WEATHER])["message"]
    assert "cannot render this conversation (assistant tool_calls, tool results, tools)" in message
