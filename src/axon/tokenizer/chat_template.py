"""Find and render the model's own Jinja chat template (ChatML only when it has none).

Discovery follows transformers: `chat_template.jinja` (with named extras in
`additional_chat_templates/*.jinja`), then `chat_template.json`, then `tokenizer_config.json`'s
`chat_template` (a string, or the named-list form `[{"name": ..., "template": ...}]`), then what
the tokenizer itself carries (a GGUF file's `tokenizer.chat_template`). `--chat-template FILE`
overrides them all. Rendering goes through the tokenizer's own `apply_chat_template`, so the
prompt is exactly what transformers renders; what axon adds is the translation of OpenAI's
message shapes into the ones HF templates expect (`messages.normalize_messages`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import stat
import weakref
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes

from axon.tokenizer.messages import (
    conversation_shapes,
    has_string_arguments,
    normalize_messages,
)

logger = logging.getLogger(__name__)

ChatTemplate = str | dict[str, str]  # one template, or named ones ("default", "tool_use", ...)


class ChatTemplateError(Exception):
    """The request's messages do not render with the model's template (the request's fault:
    the server answers 422 with `code`)."""

    code = "template_render_failed"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ChatTemplateRefused(ChatTemplateError):
    """The template itself refuses the conversation (its `raise_exception`): a shape of message
    this model cannot take at all, which the server answers with a 400 naming the shape."""


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_TEMPLATE_FILE = "chat_template.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_FILE_BYTES = 1 << 20  # a chat template override (real ones are a few KiB)
# Files of a model directory: tokenizer_config.json can carry thousands of added tokens.
MAX_MODEL_FILE_BYTES = 64 << 20

# apply_chat_template's own parameters: a request's chat_template_kwargs must not reach them
# (`tokenize: true` would hand back ids instead of the prompt text).
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)

_warned_fallback: weakref.WeakSet = weakref.WeakSet()
_warned_fallback_ids: set[int] = set()  # tokenizers that cannot be weakly referenced


# ---- discovery ------------------------------------------------------------------------------


def named_templates(value: Any) -> ChatTemplate | None:
    """A template value as HF stores it (a string, or a list of {name, template}) as a string or
    a name -> template dict; None when `value` holds no template."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    if isinstance(value, list) and value:
        try:
            return {str(item["name"]): str(item["template"]) for item in value}
        except (TypeError, KeyError):
            raise ValueError(
                "a named-list chat template needs a 'name' and a 'template' in every entry"
            ) from None
    return None


def read_regular_file(path: str | Path, max_bytes: int) -> str:
    """The UTF-8 text of the regular file at `path`, at most `max_bytes` long. Never blocks on a
    FIFO or a device: those are refused before they are opened, and the open is non-blocking in
    case one is swapped in. Raises ValueError naming the file and why."""

    def bad(why: str) -> ValueError:
        return ValueError(f"chat template file {str(path)!r}: {why}")

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise bad("not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise bad(exc.strerror or str(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise bad("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise bad(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise bad(f"larger than the {max_bytes / 2**20:g} MiB a template file may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"not UTF-8 text ({exc.reason})") from None


def _read_json_template(path: Path, max_bytes: int = MAX_MODEL_FILE_BYTES) -> ChatTemplate | None:
    try:
        data = json.loads(read_regular_file(path, max_bytes))
    except json.JSONDecodeError as exc:
        raise ValueError(f"chat template file {str(path)!r}: {exc}") from None
    return named_templates(data.get("chat_template")) if isinstance(data, dict) else None


def _read_jinja_templates(directory: Path) -> ChatTemplate | None:
    templates: dict[str, str] = {}
    if (directory / TEMPLATE_FILE).is_file():
        templates["default"] = read_regular_file(directory / TEMPLATE_FILE, MAX_MODEL_FILE_BYTES)
    extras = directory / TEMPLATE_DIR
    if extras.is_dir():
        for path in sorted(extras.glob("*.jinja")):
            name = path.name.removesuffix(".jinja")
            templates[name] = read_regular_file(path, MAX_MODEL_FILE_BYTES)
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


def find_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The chat template in a model directory, by transformers' precedence; None when it has
    none (or `model_dir` is not a directory). Raises ValueError for an unreadable file."""
    directory = Path(model_dir)
    if not directory.is_dir():
        return None
    template = _read_jinja_templates(directory)
    if template is None and (directory / LEGACY_TEMPLATE_FILE).is_file():
        template = _read_json_template(directory / LEGACY_TEMPLATE_FILE)
    if template is None and (directory / TOKENIZER_CONFIG_FILE).is_file():
        template = _read_json_template(directory / TOKENIZER_CONFIG_FILE)
    return template


def load_template_file(path: str | Path) -> ChatTemplate:
    """The template in a `--chat-template` file: Jinja text, or JSON with a `chat_template` key
    (a string or the named-list form). Blocking (run it off the event loop), but never on a
    FIFO: only a regular file of at most MAX_TEMPLATE_FILE_BYTES is read. Raises ValueError
    naming the file."""
    path = Path(path)
    if path.suffix == ".json":
        template = _read_json_template(path, MAX_TEMPLATE_FILE_BYTES)
    else:
        template = read_regular_file(path, MAX_TEMPLATE_FILE_BYTES)
    if not template:
        raise ValueError(f"chat template file {str(path)!r} holds no template")
    return template


def resolve_chat_template(
    model_path: str | Path | None, tokenizer=None, override: str | Path | None = None
) -> ChatTemplate | None:
    """The template a model renders with: the `override` file, else the model directory's
    files, else the tokenizer's own (a GGUF file's metadata); None when there is none, in which
    case the renderer falls back to ChatML. Raises ValueError for a bad override file."""
    if override is not None:
        return load_template_file(override)
    if model_path is not None:
        template = find_chat_template(model_path)
        if template is not None:
            return template
    return named_templates(getattr(tokenizer, "chat_template", None))


def select_template(template: ChatTemplate, tools: list | None = None) -> str:
    """One template out of named ones, as transformers picks it: `tool_use` when tools are
    given and the model has one, else `default`. Raises ValueError when neither applies."""
    if isinstance(template, str):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ValueError(
        f"the model has several chat templates and none is 'default': {sorted(template)}"
    )


# ---- messages -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """'openai' when the template loops over a message's content (it renders parts itself),
    else 'string' (it concatenates content as text, so parts must be joined first)."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter | nodes.Test) and target.node is not None:
            target = target.node
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return "openai"
        if isinstance(target, nodes.Getitem) and getattr(target.arg, "value", None) == "content":
            return "openai"
        if isinstance(target, nodes.Name) and target.name == "content":
            return "openai"
    return "string"


# Mistral's templates: `{%- if ... tool_call.id|length != 9 %}{{ raise_exception(...) }}`.
_CALL_ID_LENGTH = re.compile(r"""(?:\.id|\bid'\]|tool_call_id'?\]?)\s*\|\s*length\s*!=\s*(\d+)""")


@functools.lru_cache(maxsize=64)
def call_id_length(template: str) -> int | None:
    """The one length of tool call ids the template accepts (it raises on any other), or None
    when it takes any id."""
    match = _CALL_ID_LENGTH.search(template)
    return int(match.group(1)) if match else None


# ---- rendering ------------------------------------------------------------------------------


def warn_chatml_fallback(tokenizer, model_id: str = "the model") -> None:
    """Log, once per tokenizer, that chats render as ChatML because there is no template."""
    try:
        if tokenizer in _warned_fallback:
            return
        _warned_fallback.add(tokenizer)
    except TypeError:
        if id(tokenizer) in _warned_fallback_ids:
            return
        _warned_fallback_ids.add(id(tokenizer))
    logger.warning("%s has no chat template; chats render as ChatML", model_id)


def _template_for(tokenizer, chat_template: ChatTemplate | None, tools: list | None) -> str:
    template = chat_template or named_templates(getattr(tokenizer, "chat_template", None))
    if template is None:
        warn_chatml_fallback(tokenizer)
        return CHATML_TEMPLATE
    try:
        return select_template(template, tools)
    except ValueError as exc:
        raise ChatTemplateError(str(exc)) from None


def _failure(exc: Exception) -> str:
    return f"chat template failed to render: {type(exc).__name__}: {exc}"


def _refusal(exc: Exception, messages: list[dict], tools: list | None) -> str:
    shapes = ", ".join(conversation_shapes(messages, tools)) or "plain turns"
    return f"the model's chat template cannot render this conversation ({shapes}): {exc}"


def _apply(tokenizer, conversation: list[dict], tools, template: str, kwargs: dict) -> str:
    """apply_chat_template's text; raises ChatTemplateRefused for the template's own
    raise_exception (messages named later), ChatTemplateError for any other failure."""
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=template, tokenize=False, **kwargs
        )
    except jinja2.TemplateError as exc:
        if type(exc) is not jinja2.TemplateError:  # a bug in the template, not its refusal
            raise ChatTemplateError(_failure(exc)) from exc
        raise ChatTemplateRefused(str(exc)) from exc
    except ValueError as exc:
        # transformers cannot find the final message's text in what the template wrote (a
        # template that rewrites it): that turn cannot be left open.
        if kwargs.get("continue_final_message") and "continue_final_message" in str(exc):
            raise ChatTemplateRefused(str(exc)) from exc
        raise ChatTemplateError(_failure(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - any template error is the request's fault
        raise ChatTemplateError(_failure(exc)) from exc
    if not isinstance(text, str):
        raise ChatTemplateError("chat template rendered no text")
    return text


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    chat_template: ChatTemplate | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for OpenAI-shaped `messages` (normalised: messages.normalize_messages),
    rendered by the tokenizer's `apply_chat_template` with `chat_template` (default: the
    tokenizer's; ChatML, warned once, when there is none). With `continue_final_message` the
    text ends right after the final message's content (transformers cuts it there), its turn
    left open for the model to continue. `chat_template_kwargs` reach the template and override
    the defaults. Raises ChatTemplateRefused when the template refuses
    the conversation's shapes (named), ChatTemplateError naming the reason when it fails."""
    if tokenizer is None:
        raise ChatTemplateError("this model has no tokenizer")
    template = _template_for(tokenizer, chat_template, tools)
    extra = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
    kwargs = {"add_generation_prompt": add_generation_prompt, **extra}
    if continue_final_message:
        kwargs["continue_final_message"] = True
    fmt, ids = content_format(template), call_id_length(template)
    try:
        conversation = normalize_messages(messages, fmt, call_id_length=ids)
        return _apply(tokenizer, conversation, tools, template, kwargs)
    except ChatTemplateRefused as exc:
        raise ChatTemplateRefused(_refusal(exc, messages, tools)) from exc
    except ChatTemplateError as exc:
        if not has_string_arguments(messages):
            raise
        first = exc
    # Some templates concatenate a call's arguments as the string the client sent.
    conversation = normalize_messages(messages, fmt, parse_arguments=False, call_id_length=ids)
    try:
        return _apply(tokenizer, conversation, tools, template, kwargs)
    except ChatTemplateError:
        raise first from first.__cause__
