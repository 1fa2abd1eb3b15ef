"""The `/v1/responses` request body: OpenAI's Responses fields over the shared sampling fields."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from axon.server.errors import BadRequest
from axon.server.schemas.protocol import OpenAIModel, SamplingRequest
from axon.server.schemas.request_checks import (
    check_tool_choice,
    check_tools,
    text_format_as_response_format,
)
from axon.server.schemas.unsupported import RESPONSES


class ResponseText(OpenAIModel):
    """`text`: the output's format. `verbosity` other than OpenAI's default `medium` is a 400:
    no local model takes it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponseReasoning(OpenAIModel):
    """`reasoning`: `effort` as chat's reasoning_effort. A summary is never written, so asking
    for one is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: str | None = None
    summary: None = None


class ResponsesRequest(SamplingRequest):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    text: ResponseText | None = None
    reasoning: ResponseReasoning | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed in the response

    free_form = ("input", "tools", "tool_choice", "chat_template_kwargs", "text")
    unsupported = RESPONSES

    def check_shapes(self) -> None:
        super().check_shapes()
        if self.prompt_logprobs is not None:
            message = "prompt_logprobs is supported on chat and completions only"
            raise BadRequest(message, param="prompt_logprobs")
        check_tools(self.tools, flat=True)
        check_tool_choice(self.tool_choice)
        self.response_format()
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            message = "text.verbosity is not supported (only 'medium', the default)"
            raise BadRequest(message, param="text.verbosity")

    def response_format(self) -> dict | None:
        """`text.format` as chat's `response_format` (None: free text); raises BadRequest."""
        text_format = self.text.format if self.text is not None else None
        return text_format_as_response_format(text_format)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_output_tokens, "max_output_tokens"
