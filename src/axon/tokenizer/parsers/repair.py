"""Repair of the JSON that models write in tool calls, one character at a time so that a
streamed call and a whole one come out the same.

Only mistakes with one reading are repaired: a trailing comma before `}` or `]` is dropped, and
at the end of the value its open arrays and objects are closed. Anything else (a
missing value, a bare word, an unterminated string) is left as written, and `json.loads` decides.
"""

from __future__ import annotations

import json

_CLOSER = {"{": "}", "[": "]"}


class JsonScanner:
    """Scans a JSON value that ends at a `,` or `}` outside strings and brackets (the value of
    a key inside an object), or at the end of the text. Whitespace and a comma that may be
    trailing are held back until the next character says whether they belong."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open brackets, innermost last
        self.in_string = False
        self.escaped = False
        self.held = ""  # whitespace, or a comma and whitespace, outside strings

    def feed(self, text: str) -> tuple[str, int | None]:
        """(the repaired text of `text` that is final, the index in `text` where the value
        ended or None when it goes on)."""
        out: list[str] = []
        for index, char in enumerate(text):
            if self.in_string:
                out.append(char)
                self._string_char(char)
            elif char.isspace():
                self.held += char
            elif char in ",}]" and not self.stack:
                return "".join(out), index
            elif char == ",":
                out.append(self.held)
                self.held = ","
            else:
                self._value_char(char, out)
        return "".join(out), None

    def _string_char(self, char: str) -> None:
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.in_string = False

    def _value_char(self, char: str, out: list[str]) -> None:
        held = self.held
        if char in "}]":
            held = held.replace(",", "")  # a trailing comma: dropped
            self.stack.pop()
        elif char in "{[":
            self.stack.append(char)
        elif char == '"':
            self.in_string = True
        out.append(held + char)
        self.held = ""

    def closing(self) -> str:
        """What closes the value at the end of the text: its open brackets (a dangling comma or
        whitespace is dropped). Nothing inside an open string: where it meant to end is a
        guess."""
        if self.in_string:
            return ""
        return "".join(_CLOSER[bracket] for bracket in reversed(self.stack))


def repair_json(text: str):
    """The value `text` holds, parsed after the unambiguous repairs; raises ValueError when
    even the repaired text is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    scanner = JsonScanner()
    body, end = scanner.feed("[" + text.strip())  # the outer bracket: scan to the very end
    if end is not None:
        raise ValueError("the value ends before the text does")
    value = json.loads(body + scanner.closing())
    if len(value) != 1:
        raise ValueError("not one value")
    return value[0]
