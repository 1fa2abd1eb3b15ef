"""The deterministic text of benchmarks/agent_session.py's session: a coding agent's system
prompt, its tool schemas, a user task and the turns' tool calls and results, made from word and
code fragments by a seeded random generator (nothing downloaded, the same bytes every run).

Sizes are in approximate tokens (CHARS_PER_TOKEN characters each for prose, a little fewer for
code); the servers report the exact counts."""

from __future__ import annotations

import json
import random

CHARS_PER_TOKEN = 6.3  # these word lists through the demo's (Gemma 3) tokenizer
CODE_CHARS_PER_TOKEN = 3.1
GREP_CHARS_PER_TOKEN = 2.65

_WORDS = (
    "the file tool call result user request agent repository function class module test error "
    "output command directory path line change edit read write search pattern match return "
    "value string number list object schema parameter argument option default required must "
    "should never always before after when while each every only also instead prefer avoid "
    "use run check verify build install commit branch diff review explain report summary task "
    "step plan todo note warning careful exact absolute relative current working project code "
    "style format lint type import export config setting environment variable process server"
)
_IDENTIFIERS = (
    "request response handler config engine cache block token prompt session model runner "
    "scheduler sequence batch stream client server router state queue worker result buffer"
)
WORDS, IDENTIFIERS = _WORDS.split(), _IDENTIFIERS.split()
TOOLS = ("Read", "Edit", "Write", "Bash", "Grep", "Glob", "LS", "WebFetch", "TodoWrite", "Task")


def prose(rng: random.Random, tokens: int) -> str:
    """Sentences of about `tokens` tokens."""
    out, length = [], 0
    while length < tokens * CHARS_PER_TOKEN:
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 22))]
        sentence = " ".join(words).capitalize() + "."
        out.append(sentence)
        length += len(sentence) + 1
    return " ".join(out)


def tool_schemas(rng: random.Random, system_tokens: int) -> list[dict]:
    """Ten function tools whose descriptions make up about half of the system prompt."""
    each = int(system_tokens * 0.5 / len(TOOLS))
    tools = []
    for name in TOOLS:
        properties = {
            f"{rng.choice(IDENTIFIERS)}_{i}": {
                "type": rng.choice(("string", "integer", "boolean")),
                "description": prose(rng, 20),
            }
            for i in range(rng.randint(2, 5))
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": prose(rng, each - 40 * len(properties)),
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": sorted(properties)[:1],
                    },
                },
            }
        )
    return tools


def code(rng: random.Random, tokens: int) -> str:
    """Python-looking source of about `tokens` tokens, with line numbers as Read shows them."""
    lines, length = [], 0
    while length < tokens * CODE_CHARS_PER_TOKEN:
        a, b = rng.choice(IDENTIFIERS), rng.choice(IDENTIFIERS)
        line = rng.choice(
            (
                f"def {a}_{b}(self, {b}: int) -> {a.capitalize()}:",
                f"    {a} = self.{b}.get({rng.randint(0, 999)})",
                f"    if {a} is None or {b} > {rng.randint(1, 64)}:",
                f"        return {a.capitalize()}({b}={b}, {a}=None)",
                f"    # {prose(rng, 10)}",
                f"class {a.capitalize()}{b.capitalize()}:",
                f"    for {a} in self.{b}s[:{rng.randint(1, 32)}]:",
            )
        )
        lines.append(f"{len(lines) + 1:6d}\t{line}")
        length += len(lines[-1]) + 1
    return "\n".join(lines)


def tool_result(rng: random.Random, name: str, tokens: int) -> str:
    if name == "Grep":
        hits, length = [], 0
        while length < tokens * GREP_CHARS_PER_TOKEN:
            path = f"src/{rng.choice(IDENTIFIERS)}/{rng.choice(IDENTIFIERS)}.py"
            name_, value = rng.choice(IDENTIFIERS), rng.choice(IDENTIFIERS)
            hits.append(f"{path}:{rng.randint(1, 900)}:    {name_} = {value}()")
            length += len(hits[-1]) + 1
        return "\n".join(hits)
    if name == "Bash":
        return "$ python -m pytest -q\n" + code(rng, tokens // 2) + "\n" + prose(rng, tokens // 2)
    return code(rng, tokens)


def session_messages(rng: random.Random, turns: int, system_tokens: int) -> list[list[dict]]:
    """Each turn's whole message list: system, the user's task, then per turn an assistant
    message with one tool call and the tool's result (500-2,000 tokens). Turn k's list is
    turn k-1's plus two messages."""
    system = {"role": "system", "content": prose(rng, int(system_tokens * 0.33))}
    task = {
        "role": "user",
        "content": "Fix the failing test in tests/test_cache.py. " + prose(rng, 60),
    }
    history = [system, task]
    sessions = []
    for index in range(turns):
        name = rng.choice(("Read", "Grep", "Bash", "Read", "Read"))
        path = f"src/{rng.choice(IDENTIFIERS)}/{rng.choice(IDENTIFIERS)}.py"
        arguments = {"Read": {"file_path": path}, "Grep": {"pattern": rng.choice(IDENTIFIERS)}}
        call = {
            "id": f"call_{index:03d}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": json.dumps(arguments.get(name, {"command": "python -m pytest -q"})),
            },
        }
        history = history + [
            {"role": "assistant", "content": prose(rng, 15), "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": tool_result(rng, name, rng.randint(500, 2000)),
            },
        ]
        sessions.append(history)
    return sessions
