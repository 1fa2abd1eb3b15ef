"""The tool-call corpus of test_tool_call_corpus.py: outputs as real models write them,
mistakes included. A case is (id, model text, engine finish reason, expected calls, expected
content, expected finish_reason); a call is [name, arguments]: a dict the arguments must parse
to, or a str, the raw text a cut-off call keeps (not JSON: finish_reason "length" says why)."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "temp": {"type": "number"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "filter": {"type": "object"},
                "note": {"type": ["string", "null"]},
                "zone": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOW]
PARIS = {"city": "Paris", "days": 3}


def h(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


PARIS_H = h('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}')
CUT_NAME_H = '<tool_call>\n{"name": "get_ti'  # the output of issue 31

# (id, text, engine finish reason, expected calls, expected content, expected finish_reason)
HERMES = [
    ("whole", PARIS_H, "stop", [["get_weather", PARIS]], "", "tool_calls"),
    (
        "text-then-call",
        f"Let me check.\n\n{PARIS_H}",
        "stop",
        [["get_weather", PARIS]],
        "Let me check.",
        "tool_calls",
    ),
    ("cut-in-name", CUT_NAME_H, "length", [], "", "length"),
    (
        "cut-in-name-after-text",
        "Let me check.\n\n" + CUT_NAME_H,
        "length",
        [],
        "Let me check.",
        "length",
    ),
    ("cut-after-marker", "<tool_call>", "length", [], "", "length"),
    ("cut-in-marker", "Sure.\n<tool_ca", "length", [], "Sure.\n", "length"),
    (
        "cut-in-arguments",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "length",
        [["get_weather", '{"city": "Par']],
        "",
        "length",
    ),
    (
        "cut-after-comma",
        '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3, ',
        "length",
        [["get_weather", '{"days": 3']],
        "",
        "length",
    ),
    ("cut-in-end-tag", PARIS_H[:-4], "length", [["get_weather", PARIS]], "", "length"),
    (
        "cut-in-second-call",
        PARIS_H + "\n" + CUT_NAME_H,
        "length",
        [["get_weather", PARIS]],
        "",
        "length",
    ),
    (
        "cut-in-whole-layout",
        '<tool_call>\n{"arguments": {"a": 1}, "name": "no',
        "length",
        [],
        "",
        "length",
    ),
    (
        "trailing-commas",
        h('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3,}}'),
        "stop",
        [["get_weather", PARIS]],
        "",
        "tool_calls",
    ),
    (
        "nested-trailing-commas",
        h('{"name": "get_weather", "arguments": {"hours": [1, 2, ], "filter": {"a": 1,},}}'),
        "stop",
        [["get_weather", {"hours": [1, 2], "filter": {"a": 1}}]],
        "",
        "tool_calls",
    ),
    (
        "comma-in-string-kept",
        h('{"name": "now", "arguments": {"a": "x,}"}}'),
        "stop",
        [["now", {"a": "x,}"}]],
        "",
        "tool_calls",
    ),
    (
        "missing-braces-at-end-tag",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "hours": [1\n'
        "</tool_call>",
        "stop",
        [["get_weather", {"city": "Paris", "hours": [1]}]],
        "",
        "tool_calls",
    ),
    (
        "missing-braces-at-eos",
        '<tool_call>\n{"name": "now", "arguments": {"a": [1, 2',
        "stop",
        [["now", {"a": [1, 2]}]],
        "",
        "tool_calls",
    ),
    (
        "missing-end-tag",
        '<tool_call>\n{"name": "now", "arguments": {}}',
        "stop",
        [["now", {}]],
        "",
        "tool_calls",
    ),
    (
        "whole-layout-repaired",
        h('{"arguments": {"a": 1,}, "name": "now"'),
        "stop",
        [["now", {"a": 1}]],
        "",
        "tool_calls",
    ),
    (
        "not-json-is-text",
        "<tool_call>\nget_weather(Paris)\n</tool_call>",
        "stop",
        [],
        "<tool_call>\nget_weather(Paris)\n</tool_call>",
        "stop",
    ),
    (
        "open-string-is-text",
        h('{"arguments": {}, "name": "now}'),
        "stop",
        [],
        h('{"arguments": {}, "name": "now}'),
        "stop",
    ),
    ("model-stopped-in-name-is-text", CUT_NAME_H, "stop", [], CUT_NAME_H, "stop"),
    (
        "missing-end-tag-before-next-call",
        '<tool_call>\n{"name": "now", "arguments": {}}\n' + PARIS_H,
        "stop",
        [["now", {}], ["get_weather", PARIS]],
        "",
        "tool_calls",
    ),
]


def x(function: str, parameters: list[tuple[str, str]], close: str = "") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters)
    return f"<tool_call>\n<function={function}>\n{body}{close}"


PARIS_X = x("get_weather", [("city", "Paris"), ("days", "3")], "</function>\n</tool_call>")
CUT_NAME_X = "<tool_call>\n<function=get_wea"
TYPED = [
    ("city", "123"),
    ("days", "3.0"),
    ("temp", "-2.5"),
    ("metric", "True"),
    ("hours", "[1, 2,]"),
    ("filter", "{'a': None, 'b': [1]}"),
    ("note", "null"),
    ("zone", "7"),
]
TYPED_VALUES = {
    "city": "123",
    "days": 3,
    "temp": -2.5,
    "metric": True,
    "hours": [1, 2],
    "filter": {"a": None, "b": [1]},
    "note": None,
    "zone": 7,
}
END = "</function>\n</tool_call>"
XML = [
    ("whole", PARIS_X, "stop", [["get_weather", PARIS]], "", "tool_calls"),
    (
        "typed-by-schema",
        x("get_weather", TYPED, END),
        "stop",
        [["get_weather", TYPED_VALUES]],
        "",
        "tool_calls",
    ),
    (
        "not-of-its-type-stays-text",
        x("get_weather", [("days", "three"), ("note", "none yet")], END),
        "stop",
        [["get_weather", {"days": "three", "note": "none yet"}]],
        "",
        "tool_calls",
    ),
    (
        "unknown-parameter-is-a-string",
        x("now", [("x", "42")], END),
        "stop",
        [["now", {"x": "42"}]],
        "",
        "tool_calls",
    ),
    (
        "unescaped-quotes",
        x("get_weather", [("city", 'He said "hi" \\o/')], END),
        "stop",
        [["get_weather", {"city": 'He said "hi" \\o/'}]],
        "",
        "tool_calls",
    ),
    (
        "unescaped-quotes-in-object-stay-text",
        x("get_weather", [("filter", '{"q": "a "b""}')], END),
        "stop",
        [["get_weather", {"filter": '{"q": "a "b""}'}]],
        "",
        "tool_calls",
    ),
    (
        "missing-parameter-end",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n" + END,
        "stop",
        [["get_weather", PARIS]],
        "",
        "tool_calls",
    ),
    (
        "missing-function-end",
        x("get_weather", [("city", "Paris"), ("days", "3")], "</tool_call>"),
        "stop",
        [["get_weather", PARIS]],
        "",
        "tool_calls",
    ),
    (
        "missing-tool-call-end",
        x("get_weather", [("city", "Paris"), ("days", "3")], "</function>"),
        "stop",
        [["get_weather", PARIS]],
        "",
        "tool_calls",
    ),
    (
        "missing-all-ends",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3",
        "stop",
        [["get_weather", {"days": 3}]],
        "",
        "tool_calls",
    ),
    (
        "missing-ends-before-next-call",
        x("now", [], "") + PARIS_X,
        "stop",
        [["now", {}], ["get_weather", PARIS]],
        "",
        "tool_calls",
    ),
    (
        "text-then-call",
        f"Checking.\n\n{PARIS_X}",
        "stop",
        [["get_weather", PARIS]],
        "Checking.",
        "tool_calls",
    ),
    ("cut-in-name", CUT_NAME_X, "length", [], "", "length"),
    ("cut-in-name-after-text", "Checking.\n" + CUT_NAME_X, "length", [], "Checking.", "length"),
    (
        "cut-in-string",
        x("get_weather", []) + "<parameter=city>\nPar",
        "length",
        [["get_weather", '{"city": "Par']],
        "",
        "length",
    ),
    (
        "cut-in-typed-value",
        x("get_weather", [("city", "Paris")]) + "<parameter=days>\n3",
        "length",
        [["get_weather", '{"city": "Paris"']],
        "",
        "length",
    ),
    (
        "cut-in-parameter-tag",
        x("get_weather", [("city", "Paris")]) + "<parameter=da",
        "length",
        [["get_weather", '{"city": "Paris"']],
        "",
        "length",
    ),
    (
        "cut-in-end-tag",
        x("get_weather", []) + "<parameter=city>\nParis\n</param",
        "length",
        [["get_weather", '{"city": "Paris']],
        "",
        "length",
    ),
    ("cut-before-any-parameter", x("now", []), "length", [["now", ""]], "", "length"),
    ("cut-in-tool-call-end", PARIS_X[:-3], "length", [["get_weather", PARIS]], "", "length"),
    (
        "not-a-function-is-text",
        "<tool_call>\nnot a function\n</tool_call>",
        "stop",
        [],
        "<tool_call>\nnot a function\n</tool_call>",
        "stop",
    ),
]
