"""Anthropic's context editing (`context_management`, beta), as far as it is honoured here.

Claude Code sends `{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}` with thinking
on. `clear_thinking_20251015` is honoured: the thinking blocks of all but the last `keep`
assistant turns that have some are left out of the prompt (`"all"`: none are; Anthropic's
default keeps one turn), and the response reports it under `context_management.applied_edits`.
`clear_tool_uses_20250919` (replacing old tool results once the prompt passes a token trigger,
with `clear_at_least`, `exclude_tools` and `clear_tool_inputs`) is refused with a 400 naming the
edit's type: clearing tool results is the client's choice to make, in the history it sends.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from axon.server.errors import BadRequest

CLEAR_THINKING = "clear_thinking_20251015"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ThinkingTurns(_Strict):
    type: Literal["thinking_turns"]
    value: Annotated[int, Field(ge=1)]


class ClearThinking(_Strict):
    type: str
    keep: Literal["all"] | ThinkingTurns = ThinkingTurns(type="thinking_turns", value=1)

    @field_validator("type")
    @classmethod
    def _honoured(cls, value: str) -> str:
        if value != CLEAR_THINKING:
            raise ValueError(
                f"{value!r} is not supported: only {CLEAR_THINKING!r} is (old tool results are "
                "the client's to clear, in the history it sends)"
            )
        return value


class ContextManagement(_Strict):
    edits: list[ClearThinking] = []


def _thinking_turns(messages: list[Any]) -> list[int]:
    """The indexes of the assistant turns (Anthropic messages) that hold thinking blocks."""
    return [
        index
        for index, message in enumerate(messages)
        if message.role == "assistant"
        and not isinstance(message.content, str)
        and any(block.type == "thinking" for block in message.content)
    ]


def cleared_thinking_turns(body: Any) -> list[int]:
    """The indexes of the assistant turns of `body` (a Messages or count_tokens request) whose
    thinking its `context_management` clears; raises BadRequest when it asks to clear thinking
    with thinking off, as Anthropic's API does."""
    edits = body.context_management.edits if body.context_management else []
    for index, edit in enumerate(edits):
        if body.thinking is None or body.thinking.type == "disabled":
            param = f"context_management.edits[{index}].type"
            message = f"{param}: {edit.type} requires thinking to be enabled or adaptive"
            raise BadRequest(message, param=param)
        if edit.keep != "all":
            turns = _thinking_turns(body.messages)
            return turns[: max(len(turns) - edit.keep.value, 0)]
    return []
