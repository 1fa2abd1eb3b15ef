"""`SamplingParams.structured_output` -> an llguidance Lark grammar.

    {"type": "json_object"}                          any JSON object
    {"type": "json_schema", "schema": {...}}         JSON valid under the schema
    {"type": "tool_call", "format": "hermes" | "qwen3_coder",
     "tools": [{"name", "parameters"}], "parallel": bool}
                                                     one call (or several, when parallel) in
                                                     the model family's own markup
    ... "optional": true, "free_tools": [names]     tool_choice "auto" with strict tools:
                                                     free text, or text then calls; `tools`
                                                     are the strict ones, `free_tools` called
                                                     with any arguments

Any of them may carry "thinking": "optional" (the output may open with a `<think>…</think>`
block, left free) or "started" (the prompt opened it: the output starts inside it). JSON is
generated compactly (`{"a": 1, "b": 2}`): free whitespace lets a weak model loop on newlines.
"""

from __future__ import annotations

import json

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The markers are single (added) tokens, which llguidance names `<think>` outside quotes; free
# text cannot contain them, so a greedy think_text still ends at `</think>`.
_THINK = {
    "optional": "start: (<think> think_text </think> /[ \\t\\n]*/)? body",
    "started": "start: think_text </think> /[ \\t\\n]*/ body",
}


def _json(schema: dict) -> str:
    """An inline `%json{…}` of `schema`, in the compact style."""
    styled = dict(schema)
    styled["x-guidance"] = {**_JSON_STYLE, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(styled, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _hermes_call(tool: dict) -> str:
    schema = {
        "type": "object",
        "properties": {
            "name": {"const": tool["name"]},
            "arguments": tool.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return f'<tool_call> "\\n" {_json(schema)} "\\n" </tool_call>'


def _string_enum(schema) -> bool:
    """Whether `schema` is an enum of strings only (its type string or left out)."""
    if not isinstance(schema, dict) or not schema.get("enum"):
        return False
    strings = all(isinstance(member, str) for member in schema["enum"])
    return strings and schema.get("type", "string") == "string"


def _xml_call(tool: dict, rule: str) -> tuple[str, list[str]]:
    """The call's expression and the rules its parameters need."""
    parameters = tool.get("parameters") or {}
    required = set(parameters.get("required") or [])
    parts, rules = [], []
    for number, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
        value = f"{rule}_{number}"
        if isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema:
            # Lazy: the shortest text up to the closing tag, which the value includes.
            rules.append(f"{value}[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/")
        elif _string_enum(schema):
            # The parser keeps a string parameter's text as written: the bare member, no quotes.
            members = " | ".join(_literal(member) for member in schema["enum"])
            rules.append(f'{value}: ({members}) "\\n</parameter>\\n"')
        else:
            json_value = _json(schema if isinstance(schema, dict) else {})
            rules.append(f'{value}: {json_value} "\\n</parameter>\\n"')
        part = f"{_literal(f'<parameter={key}>{chr(10)}')} {value}"
        parts.append(part if key in required else f"({part})?")
    head = _literal(f"\n<function={tool['name']}>\n")
    return f'<tool_call> {head} {" ".join(parts)} "</function>\\n" </tool_call>', rules


def _free_call(spec: dict) -> str:
    """A call to one of `free_tools` (non-strict, beside strict ones) with any arguments."""
    names = spec["free_tools"]
    if spec["format"] == "hermes":
        schema = {
            "type": "object",
            "properties": {"name": {"enum": names}, "arguments": {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        return f'<tool_call> "\\n" {_json(schema)} "\\n" </tool_call>'
    heads = " | ".join(_literal(f"\n<function={name}>\n") for name in names)
    return f"<tool_call> ({heads}) free_text </tool_call>"


def _tool_call_body(spec: dict) -> list[str]:
    """Rules of `body`: one call to any of the tools, or several when parallel; with
    `optional`, free text instead, or text before the calls."""
    calls, rules = [], []
    for number, tool in enumerate(spec["tools"]):
        if spec["format"] == "hermes":
            calls.append(_hermes_call(tool))
        else:
            expression, extra = _xml_call(tool, f"p{number}")
            calls.append(expression)
            rules += extra
    if spec.get("free_tools"):
        calls.append(_free_call(spec))
    rules.append("call: " + " | ".join(f"({c})" for c in calls))
    rules.append('calls: call ("\\n" call)*' if spec.get("parallel") else "calls: call")
    rules.append("body: free_text? calls?" if spec.get("optional") else "body: calls")
    if spec.get("free_tools") or spec.get("optional"):
        # The call markers are single tokens that free text cannot contain: it ends at one.
        rules.append("free_text: /(.|\\n)+/")
    return rules


def _body(spec: dict) -> list[str]:
    kind = spec["type"]
    if kind == "json_object":
        return [f"body: {_json({'type': 'object'})}"]
    if kind == "json_schema":
        return [f"body: {_json(spec['schema'])}"]
    if kind == "tool_call":
        return _tool_call_body(spec)
    raise ValueError(f"unknown structured output type {kind!r}")


def build_grammar(spec: dict) -> str:
    """The llguidance grammar (serialized) that `spec` describes."""
    from llguidance import LLMatcher

    rules = _body(spec)
    thinking = spec.get("thinking")
    start = _THINK.get(thinking, "start: body")
    if thinking in _THINK:
        rules.append("think_text: /(.|\\n)*/")
    return LLMatcher.grammar_from_lark("\n".join([start, *rules]))
