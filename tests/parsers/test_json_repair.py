"""The JSON repairs the tool-call parsers share, and the XML parser's schema typing: only
mistakes with one reading are repaired, anything else is refused (or stays a string)."""

from __future__ import annotations

import pytest

from axon.tokenizer.parsers.qwen3_coder import convert_value, parameter_types
from axon.tokenizer.parsers.repair import repair_json


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"a": 1}', {"a": 1}),
        ('{"a": [1, 2,], }', {"a": [1, 2]}),
        ('{"a": {"b": [1', {"a": {"b": [1]}}),
        ('{"a": "x,]"', {"a": "x,]"}),
        ("[1, 2,\n]", [1, 2]),
    ],
)
def test_repairs(text, value):
    assert repair_json(text) == value


@pytest.mark.parametrize("text", ['{"a": "x', '{"a": }', '{"a": 1}}', "1, 2", "{'a': 1}", ""])
def test_refusals(text):
    with pytest.raises(ValueError):
        repair_json(text)


@pytest.mark.parametrize(
    ("text", "kinds", "value"),
    [
        ("42", "integer", 42),
        ("4.0", "integer", 4),
        ("4.5", "integer", "4.5"),
        ("-2.5", "number", -2.5),
        ("nan", "number", "nan"),
        ("FALSE", "boolean", False),
        ("yes", "boolean", "yes"),
        ("None", ("string", "null"), None),
        ("Paris", ("string", "null"), "Paris"),
        ("007", ("string", "integer"), "007"),
        ('{"a": [1,],}', "object", {"a": [1]}),
        ("{'a': (1, 2)}", "object", {"a": (1, 2)}),
        ("[1, 2]", "object", "[1, 2]"),
        ("3", ("null", "integer"), 3),
    ],
)
def test_convert_value(text, kinds, value):
    assert convert_value(text, kinds) == value


def test_parameter_types_read_type_lists_and_any_of():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": ["integer", "null"]},
            "b": {"anyOf": [{"type": "array"}, {"type": "null"}]},
            "c": {"enum": ["x", "y"]},
        },
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert parameter_types(tools) == {
        "f": {"a": ("integer", "null"), "b": ("array", "null"), "c": ("string",)}
    }
