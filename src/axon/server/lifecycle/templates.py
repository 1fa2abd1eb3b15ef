"""A load spec's `chat_template`: template text, or the name of a template file.

The operator's own spec (MODEL with `--chat-template FILE`, `default_models`) may name any file.
A `POST /models/load` may not: whatever file becomes the template, `/tokenize` with messages and
`/detokenize` hand its text back, so the node API would read files for anyone who can reach it.
Its `chat_template` is template text (Jinja: it holds `{{` or `{%`), or a file inside the
model's own folder (at most one folder down, as a checkpoint lays out its templates, resolved
inside the allowed roots like the model's other files), or a file in the operator's
`chat_template_dir`. Any other name, existing or not, gets the same refusal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from axon.server.config import ServerConfig
from axon.server.errors import BadRequest
from axon.server.lifecycle.local_paths import PathNotAllowed, local_model_path, shown
from axon.server.lifecycle.sources import model_file_roots
from axon.server.schemas.node_protocol import ModelSpec
from axon.tokenizer.chat_template import MAX_TEMPLATE_FILE_BYTES, ChatTemplate, load_template_file

TEMPLATE_MARKERS = ("{{", "{%")
MAX_FOLDER_DEPTH = 2  # `chat_template.jinja`, `additional_chat_templates/tool_use.jinja`


def is_template_text(value: str) -> bool:
    """Whether a spec's `chat_template` is the template itself rather than a file name."""
    return any(marker in value for marker in TEMPLATE_MARKERS)


def check_chat_template(
    spec: ModelSpec,
    config: ServerConfig,
    environ: Mapping[str, str] | None = None,
    trusted: bool = False,
) -> None:
    """Refuses, before the model is resolved or anything downloaded and without touching the
    disk, what no model folder could make right: template text over 1 MiB, and an absolute file
    name outside every root and `chat_template_dir` (PathNotAllowed, param `chat_template`)."""
    value = spec.chat_template
    if value is None or trusted:
        return
    if is_template_text(value):
        if len(value.encode()) > MAX_TEMPLATE_FILE_BYTES:
            raise BadRequest("chat_template text is larger than 1 MiB", param="chat_template")
        return
    if "\0" in value or len(value) > 4096:
        raise _refused(value)
    if os.path.isabs(os.path.expanduser(value)):  # a relative name is the model folder's
        environ = os.environ if environ is None else environ
        bases = [*model_file_roots(config, environ)]
        if config.chat_template_dir is not None:
            bases.append(Path(config.chat_template_dir))
        bases += [Path(os.path.realpath(base)) for base in bases]
        absolute = Path(os.path.abspath(os.path.expanduser(value)))
        if not any(absolute.is_relative_to(Path(os.path.abspath(b))) for b in bases):
            raise _refused(value)


def read_chat_template(
    spec: ModelSpec,
    config: ServerConfig,
    environ: Mapping[str, str] | None = None,
    trusted: bool = False,
    model_path: Path | None = None,
) -> ChatTemplate | None:
    """The template `spec.chat_template` gives, or None when it gives none: its text, or the
    file it names read once (a trusted spec's from anywhere, else from the folder of the model
    at `model_path` or from `chat_template_dir`). Blocking; run it in a thread. Raises
    BadRequest (param `chat_template`): PathNotAllowed for a name found in neither place, or a
    file that is not a regular one, too large, or holds no template."""
    value = spec.chat_template
    if value is None:
        return None
    check_chat_template(spec, config, environ, trusted)
    if not trusted and is_template_text(value):
        return value
    if trusted:
        path = local_model_path(value, None, param="chat_template") or value
    else:
        environ = os.environ if environ is None else environ
        path = _find_template_file(value, config, environ, model_path)
    try:
        return load_template_file(path)
    except ValueError as exc:
        raise BadRequest(str(exc), param="chat_template") from None


def _find_template_file(
    name: str, config: ServerConfig, environ: Mapping[str, str], model_path: Path | None
) -> Path:
    places = []
    if model_path is not None:
        folder = model_path if model_path.is_dir() else model_path.parent
        places.append((folder, model_file_roots(config, environ), MAX_FOLDER_DEPTH))
    if config.chat_template_dir is not None:
        directory = Path(os.path.expanduser(config.chat_template_dir))
        places.append((directory, (directory,), None))
    for base, roots, max_depth in places:
        found = _file_in(name, base, roots, max_depth)
        if found is not None:
            return found
    raise _refused(name)


def _file_in(name: str, base: Path, roots, max_depth: int | None) -> Path | None:
    """The file `name` names inside `base` (relative to it, or absolute under it), resolved,
    when it lies no deeper than `max_depth` and resolves inside `roots`; else None."""
    base = Path(os.path.abspath(base))
    lexical = Path(os.path.abspath(os.path.join(base, os.path.expanduser(name))))
    for spelling in (base, Path(os.path.realpath(base))):
        if lexical.is_relative_to(spelling):
            depth = len(lexical.relative_to(spelling).parts)
            break
    else:
        return None
    if depth == 0 or max_depth is not None and depth > max_depth:
        return None
    real = Path(os.path.realpath(lexical))
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    if not any(real.is_relative_to(root) for root in real_roots) or not real.exists():
        return None
    return real


def _refused(name: str) -> PathNotAllowed:
    return PathNotAllowed(
        f"chat_template {shown(name)} is neither template text (Jinja, with '{{{{' or '{{%') "
        "nor a file in the model's folder or in the chat template directory "
        "(chat_template_dir)",
        param="chat_template",
    )
