"""Chat templates: real model templates (llama.cpp's corpus) rendered through axon's chat route
equal transformers' `apply_chat_template`; discovery precedence, named templates, the
`--chat-template` override, render failures and the ChatML fallback."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from axon.server.chat_pipeline import chat_prompt
from axon.server.errors import BadRequest
from axon.server.lifecycle.served_model import ServedModel
from axon.server.schemas.protocol import ChatCompletionRequest, parse_request
from axon.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplateError,
    content_format,
    find_chat_template,
    load_template_file,
    render_chat,
    resolve_chat_template,
)

IMAGE = "data:image/png;base64,iVBORw0KGgo="
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]
# OpenAI's wire form: arguments are a JSON string.
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
}
SYSTEM_USER = [
    {"role": "system", "content": "You are terse. Réponds en français."},
    {"role": "user", "content": "Quelle heure est-il ? 🕰️"},
    {"role": "assistant", "content": "Il est midi."},
    {"role": "user", "content": "Et à Tokyo ?"},
]
TOOL_TURNS = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]
TEXT_PARTS = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Two"}],
    }
]
IMAGE_PARTS = [
    {"role": "system", "content": "Describe images."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "text", "text": "Be brief."},
        ],
    },
]
CONVERSATIONS = {
    "system_user": (SYSTEM_USER, None),
    "tools": (TOOL_TURNS, TOOLS),
    "text_parts": (TEXT_PARTS, None),
}
TEMPLATES = {  # name in llama.cpp's models/templates -> (tokenizer family, renders images)
    "Qwen-Qwen3-0.6B": ("qwen3", False),
    "Qwen3.5-4B": ("qwen3_5", True),
    "Qwen3-Coder": ("qwen3", False),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", False),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3", False),
    "google-gemma-4-31B-it": ("gemma", True),  # the corpus has no Gemma 3; Gemma 4 is its heir
}
THINKING = ("Qwen-Qwen3-0.6B", "Qwen3.5-4B", "google-gemma-4-31B-it")


def _word_tokenizer(bos: str, eos: str):
    """A tokenizer that knows only its specials: rendering reads no more of it than those."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"<unk>": 0, bos: 1, eos: 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def tokenizers(request):
    return {
        "qwen3": lambda: request.getfixturevalue("qwen3_tokenizer"),
        "qwen3_5": lambda: request.getfixturevalue("qwen3_5_tokenizer"),
        "llama3": lambda: _word_tokenizer("<|begin_of_text|>", "<|eot_id|>"),
        "gemma": lambda: _word_tokenizer("<bos>", "<eos>"),
    }


def _served(tokenizer, template) -> ServedModel:
    model = ServedModel.__new__(ServedModel)  # the render path only: no engine behind it
    model.id, model.tokenizer, model.chat_template = "m", tokenizer, template
    model.max_model_len = 1 << 20
    return model


def _axon(tokenizer, template, messages, tools=None, **kwargs) -> str:
    body = {"model": "m", "messages": messages, **kwargs}
    if tools is not None:
        body["tools"] = tools
    request = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    text, ids = chat_prompt(_served(tokenizer, template), request)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    return text


def _hf_messages(messages, template: str) -> list[dict]:
    """The same conversation as transformers' docs write it: tool-call arguments as mappings,
    images as {"type": "image", "url": ...}, text parts joined for templates that only take
    strings (they would fail on a list)."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        content = message.get("content")
        if isinstance(content, list) and content_format(template) == "string":
            message["content"] = "\n".join(p["text"] for p in content if p["type"] == "text")
        elif isinstance(content, list):
            message["content"] = [
                {"type": "image", "url": p["image_url"]["url"]} if p["type"] == "image_url" else p
                for p in content
            ]
    return messages


def _transformers(tokenizer, template, messages, tools=None, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        _hf_messages(messages, template),
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )


def _cases():
    for name, (family, images) in TEMPLATES.items():
        for conversation in CONVERSATIONS:
            yield pytest.param(name, family, conversation, id=f"{name}-{conversation}")
        if images:
            yield pytest.param(name, family, "images", id=f"{name}-images")


@pytest.mark.parametrize(("name", "family", "conversation"), list(_cases()))
def test_render_equals_transformers(template_dir, tokenizers, name, family, conversation):
    template = (template_dir / f"{name}.jinja").read_text()
    tokenizer = tokenizers[family]()
    if conversation == "images":
        messages, tools = IMAGE_PARTS, None
    else:
        messages, tools = CONVERSATIONS[conversation]
    ours = _axon(tokenizer, template, messages, tools)
    assert ours == _transformers(tokenizer, template, messages, tools)
    if tools is not None:
        assert "get_weather" in ours and "Paris" in ours
    if conversation == "images":
        assert ours.count("image") >= 2


@pytest.mark.parametrize("name", THINKING)
@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_switch_reaches_the_template(template_dir, tokenizers, name, thinking):
    template = (template_dir / f"{name}.jinja").read_text()
    tokenizer = tokenizers[TEMPLATES[name][0]]()
    kwargs = {"enable_thinking": thinking}
    ours = _axon(tokenizer, template, SYSTEM_USER, chat_template_kwargs=kwargs)
    assert ours == _transformers(tokenizer, template, SYSTEM_USER, **kwargs)
    other = _axon(
        tokenizer, template, SYSTEM_USER, chat_template_kwargs={"enable_thinking": not thinking}
    )
    assert ours != other


def test_content_format_detection(template_dir):
    def fmt(name):
        return content_format((template_dir / f"{name}.jinja").read_text())

    assert fmt("Qwen-Qwen3-0.6B") == "string"
    assert fmt("meta-llama-Llama-3.1-8B-Instruct") == "string"
    assert fmt("Qwen3.5-4B") == "openai"
    assert fmt("google-gemma-4-31B-it") == "openai"
    assert content_format(CHATML_TEMPLATE) == "string"


# ---- discovery ------------------------------------------------------------------------------


def _write(directory, jinja=None, legacy=None, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    if legacy is not None:
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": legacy}))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": config}))
    return directory


def test_precedence_jinja_then_json_then_tokenizer_config(tmp_path):
    assert find_chat_template(_write(tmp_path / "a", "J", "L", "C")) == "J"
    assert find_chat_template(_write(tmp_path / "b", None, "L", "C")) == "L"
    assert find_chat_template(_write(tmp_path / "c", None, None, "C")) == "C"
    assert find_chat_template(_write(tmp_path / "d")) is None
    (tmp_path / "d" / "tokenizer_config.json").write_text("{}")
    assert find_chat_template(tmp_path / "d") is None


def test_named_templates_select_like_transformers(tmp_path, qwen3_tokenizer):
    named = [{"name": "default", "template": "D{{ messages[0].content }}"}]
    named.append({"name": "tool_use", "template": "T{{ tools[0].function.name }}"})
    template = find_chat_template(_write(tmp_path / "m", config=named))
    assert template == {"default": "D{{ messages[0].content }}", "tool_use": named[1]["template"]}
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(qwen3_tokenizer, messages, chat_template=template) == "Dhi"
    assert render_chat(qwen3_tokenizer, messages, TOOLS, chat_template=template) == "Tget_weather"
    reference = copy.copy(qwen3_tokenizer)
    reference.chat_template = template
    assert reference.apply_chat_template(messages, tools=TOOLS, tokenize=False) == "Tget_weather"
    with pytest.raises(ChatTemplateError) as info:
        render_chat(qwen3_tokenizer, messages, chat_template={"other": "x"})
    assert info.value.code == "template_render_failed"


def test_additional_chat_templates_dir(tmp_path):
    directory = _write(tmp_path / "m", jinja="D")
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    assert find_chat_template(directory) == {"default": "D", "tool_use": "T"}


def test_override_file_wins(tmp_path, qwen3_tokenizer):
    directory = _write(tmp_path / "m", jinja="model's own")
    override = tmp_path / "mine.jinja"
    override.write_text("override {{ messages[0].content }}")
    assert resolve_chat_template(directory, qwen3_tokenizer, override) == override.read_text()
    assert resolve_chat_template(directory, qwen3_tokenizer) == "model's own"
    as_json = tmp_path / "mine.json"
    as_json.write_text(json.dumps({"chat_template": [{"name": "default", "template": "J"}]}))
    assert load_template_file(as_json) == {"default": "J"}
    with pytest.raises(ValueError, match="missing.jinja"):
        load_template_file(tmp_path / "missing.jinja")


def test_tokenizer_template_used_when_the_directory_has_none(tmp_path, qwen3_tokenizer):
    # A GGUF file: transformers puts its `tokenizer.chat_template` metadata on the tokenizer.
    tokenizer = copy.copy(qwen3_tokenizer)
    tokenizer.chat_template = "from gguf"
    assert resolve_chat_template(tmp_path / "model.gguf", tokenizer) == "from gguf"


def test_serve_flag_reaches_the_model_spec(tmp_path):
    import argparse

    from axon.server.serve_args import add_serve_args, config_from_namespace

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    template = tmp_path / "t.jinja"
    ns = parser.parse_args(["some/model", "--chat-template", str(template)])
    config = config_from_namespace(ns, environ={})
    assert config.default_models[0].chat_template == str(template)
    with pytest.raises(ValueError, match="--chat-template"):
        config_from_namespace(parser.parse_args(["--chat-template", "x"]), environ={})


# ---- failures and the fallback --------------------------------------------------------------


def test_template_raising_is_a_bad_request_with_the_reason(template_dir, qwen3_5_tokenizer):
    template = (template_dir / "Qwen3.5-4B.jinja").read_text()
    system_image = [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(BadRequest) as info:
        _axon(qwen3_5_tokenizer, template, system_image)
    assert info.value.code == "template_render_failed"
    assert "System message cannot contain images." in info.value.message
    assert "a system message, content parts" in info.value.message
    assert info.value.param == "messages"


def test_chat_template_kwargs_cannot_reach_apply_chat_template_options(qwen3_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"tokenize": True, "return_dict": True, "custom": "X"}
    text = render_chat(
        qwen3_tokenizer,
        messages,
        None,
        kwargs,
        chat_template="{{ custom }}{{ messages[0].content }}",
    )
    assert text == "Xhi"


def test_chatml_fallback_logged_once(qwen3_tokenizer, caplog):
    tokenizer = copy.copy(qwen3_tokenizer)
    tokenizer.chat_template = None
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with caplog.at_level(logging.WARNING, logger="axon.tokenizer.chat_template"):
        first = render_chat(tokenizer, messages)
        second = render_chat(tokenizer, messages)
    assert first == second == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    warnings = [r for r in caplog.records if "ChatML" in r.getMessage()]
    assert len(warnings) == 1
