"""The tool-call parsers of every family, fed whole, split in two at every character boundary
and one character at a time: the same content, reasoning and calls every way, no markup in
content, and malformed markup returned as text."""

from __future__ import annotations

import pytest

from axon.tokenizer.parsers import ParserFamily, make_output_parser, parser_family

from .helpers import assert_no_markup, parse_every_way

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
PARIS = {"city": "Paris", "days": 3}
TOKYO = {"city": 'Tōkyō "east"\nline', "metric": True, "hours": [1, 2]}


def make(tool_format: str, thinking: bool = True):
    family = ParserFamily(reasoning=thinking, tool_format=tool_format)
    return lambda: make_output_parser(family, prompt="assistant\n", tools=TOOLS)


def hermes_call(name: str, arguments_json: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments_json}}}\n</tool_call>'


def xml_call(name: str, parameters: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS_H = hermes_call("get_weather", '{"city": "Paris", "days": 3}')
TOKYO_H = hermes_call(
    "get_weather", '{"city": "Tōkyō \\"east\\"\\nline", "metric": true, "hours": [1, 2]}'
)
PARIS_X = xml_call("get_weather", {"city": "Paris", "days": "3"})
TOKYO_X = xml_call(
    "get_weather", {"city": 'Tōkyō "east"\nline', "metric": "true", "hours": "[1, 2]"}
)

# (output, expected reasoning, expected content, expected [(name, arguments)])
COMMON = [
    ("<think>\nPlan.\n</think>\n\nHello there.", "Plan.", "Hello there.", []),
    ("Only content here.\n", "", "Only content here.\n", []),
]
HERMES = [
    *COMMON,
    (PARIS_H, "", "", [("get_weather", PARIS)]),
    (f"{PARIS_H}\n{TOKYO_H}", "", "", [("get_weather", PARIS), ("get_weather", TOKYO)]),
    (f"Let me check.\n\n{PARIS_H}", "", "Let me check.", [("get_weather", PARIS)]),
    (f"<think>\nuse a tool\n</think>\n\n{PARIS_H}", "use a tool", "", [("get_weather", PARIS)]),
    (hermes_call("now", "{}"), "", "", [("now", {})]),
    (
        '<tool_call>\n{"arguments": {"a": 1}, "name": "now"}\n</tool_call>',
        "",
        "",
        [("now", {"a": 1})],
    ),
    ('<tool_call>\n{"name": "now", "arguments": {"a": 1}}', "", "", [("now", {"a": 1})]),
    # Brackets left open by `</tool_call>` are closed (tests/parsers/test_tool_call_corpus.py).
    (
        '<tool_call>{"name": "now", "arguments": {"a": [1]</tool_call>ok',
        "",
        "ok",
        [("now", {"a": [1]})],
    ),
]
HERMES_MALFORMED = [
    "<tool_call>\nnot json at all\n</tool_call>",
    'Text <tool_call>{"name": x, "arguments": {}}</tool_call>',
    "<tool_call>\n{",
]
XML = [
    *COMMON,
    (PARIS_X, "", "", [("get_weather", PARIS)]),
    (f"{PARIS_X}\n{TOKYO_X}", "", "", [("get_weather", PARIS), ("get_weather", TOKYO)]),
    (f"Let me check.\n\n{PARIS_X}", "", "Let me check.", [("get_weather", PARIS)]),
    (f"<think>\nuse a tool\n</think>\n\n{PARIS_X}", "use a tool", "", [("get_weather", PARIS)]),
    ("<tool_call>\n<function=now>\n</function>\n</tool_call>", "", "", [("now", {})]),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n</tool_call>",
        "",
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    ("<tool_call>\n<function=now>\n<parameter=x>\n1", "", "", [("now", {"x": "1"})]),
]
XML_MALFORMED = [
    "<tool_call>\nnot a function\n</tool_call>",
    "Text <tool_call><func=x></tool_call> more",
    "<tool_call>\n<function",
]


def check(tool_format: str, text: str, reasoning: str, content: str, calls: list) -> None:
    parsed = parse_every_way(make(tool_format), text)
    assert parsed.reasoning == reasoning
    assert parsed.content == content
    assert parsed.tool_calls() == calls
    assert_no_markup(parsed.content)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), HERMES)
def test_hermes(text, reasoning, content, calls):
    check("hermes", text, reasoning, content, calls)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), XML)
def test_qwen3_coder(text, reasoning, content, calls):
    check("qwen3_coder", text, reasoning, content, calls)


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [("hermes", t) for t in HERMES_MALFORMED] + [("qwen3_coder", t) for t in XML_MALFORMED],
)
def test_malformed_markup_is_returned_as_text(tool_format, text):
    parsed = parse_every_way(make(tool_format, thinking=False), text)
    assert parsed.calls == []
    assert parsed.content == text


def test_streamed_arguments_are_the_models_json_verbatim():
    parsed = parse_every_way(make("hermes"), PARIS_H)
    assert parsed.calls == [["get_weather", '{"city": "Paris", "days": 3}']]


def test_no_tools_means_no_tool_parsing():
    family = ParserFamily(reasoning=False, tool_format="hermes")
    parser = make_output_parser(family, tools=None)
    assert parser.tools is None
    events = parser.feed(PARIS_H) + parser.finish()
    assert "".join(e.text for e in events) == PARIS_H


class _Tokenizer:
    def __init__(self, vocab, template):
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self):
        return self.vocab


@pytest.mark.parametrize(
    ("template", "model_type", "tool_format"),
    [
        ("{{ '<tool_call>' }}", "qwen3", "hermes"),
        ("<tool_call>\n<function=", "qwen3_moe", "qwen3_coder"),
        ("", "qwen3_5", "qwen3_coder"),
        ("", "qwen2", "hermes"),
        ("", "llama", None),
    ],
)
def test_family_registry(template, model_type, tool_format):
    vocab = {m: i for i, m in enumerate(("<think>", "</think>", "<tool_call>", "</tool_call>"))}
    family = parser_family(_Tokenizer(vocab, template), model_type)
    assert family == ParserFamily(reasoning=True, tool_format=tool_format)
    assert parser_family(_Tokenizer({}, template), model_type) == ParserFamily(False, None)
