"""Render chat messages with the model's own Jinja template (ChatML when it has none)."""

from __future__ import annotations

import logging

from axon.server.errors import Unprocessable

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_warned_fallback: set[int] = set()


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text. Raises Unprocessable(code="template_render_failed") when the template
    raises."""
    if tokenizer is None:
        raise Unprocessable("this model has no tokenizer", code="template_render_failed")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        if id(tokenizer) not in _warned_fallback:
            _warned_fallback.add(id(tokenizer))
            logger.warning("the model has no chat template; using ChatML")
        template = CHATML_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - any template error is the request's fault
        raise Unprocessable(
            f"chat template failed to render: {type(exc).__name__}: {exc}",
            code="template_render_failed",
        ) from exc
