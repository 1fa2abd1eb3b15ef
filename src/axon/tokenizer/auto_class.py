"""A model directory's tokenizer as `AutoTokenizer.from_pretrained` builds it, without importing
torch on a repeat load.

AutoTokenizer picks the tokenizer class from the model's config, which it reads through
transformers' config classes, whose module imports torch: the bulk of a tokenizer load, in an
HTTP process that needs no torch otherwise. The class it picks is a function of the directory's
files (config.json, tokenizer_config.json, tokenizer.json, which files exist) and the
transformers version. So the first load records the class in axon's cache under a key of those,
and a later load of the same files imports that class alone and calls its `from_pretrained` with
the arguments AutoTokenizer passes: the same class, built the same way from the same files. A
class outside transformers (remote code) is never recorded.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from pathlib import Path

from axon.cache_dir import cached_entry, discard

logger = logging.getLogger(__name__)

KIND = "tokenizer-classes"
CLASS_FILE = "class.json"
# Part of the key: names what an entry holds (bump when CLASS_FILE changes shape).
FORMAT = "tokenizer-class/1"
# What AutoTokenizer reads to choose the class (tokenizer.json: whether it is byte-level).
_CHOICE_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def load_auto_tokenizer(path: str):
    """The tokenizer of the model directory (or hub id) `path`, of the class and built as
    `AutoTokenizer.from_pretrained(path)` builds it. Writes a cache entry on a miss. Raises what
    AutoTokenizer raises."""
    key = class_key(path)
    if key is None:
        return _auto_tokenizer(path)
    built: list = []

    def build(directory: Path) -> None:
        built.append(_auto_tokenizer(path))
        (directory / CLASS_FILE).write_text(json.dumps(class_ref(type(built[0]))))

    try:
        entry, _ = cached_entry(KIND, key, build)
    except OSError as exc:  # an unwritable cache costs the torch import, never the tokenizer
        logger.warning("tokenizer class not cached (%s)", exc)
        return built[0] if built else _auto_tokenizer(path)
    if built:
        return built[0]
    try:
        tokenizer_class = import_class(json.loads((entry / CLASS_FILE).read_text()))
    except (ImportError, AttributeError, ValueError, KeyError, TypeError):
        discard(entry)  # e.g. a class the installed transformers lacks: the next load rebuilds
        return _auto_tokenizer(path)
    if tokenizer_class is None:
        return _auto_tokenizer(path)
    # AutoTokenizer's own call: `_from_auto` and the resolved revision (None for a directory).
    return tokenizer_class.from_pretrained(path, _from_auto=True, revision=None)


def class_key(path: str) -> str | None:
    """The cache key of the class AutoTokenizer picks for the directory `path`, or None for
    what is not a local directory (a hub id: resolved by AutoTokenizer every time)."""
    directory = Path(path)
    if not directory.is_dir():
        return None
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    names = sorted(entry.name for entry in directory.iterdir())
    # A relative path is also the config's `_name_or_path`, which AutoTokenizer matches
    # against hub ids; an absolute one never matches them.
    where = "" if os.path.isabs(path) else str(path)
    parts = [FORMAT, transformers.__version__, tokenizers.__version__, where, names]
    digest.update(json.dumps(parts).encode())
    for name in _CHOICE_FILES:
        if (directory / name).is_file():
            with (directory / name).open("rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()[:32]


def class_ref(tokenizer_class: type) -> dict:
    """What CLASS_FILE holds: the class's module and name; None for one outside transformers."""
    if not tokenizer_class.__module__.startswith("transformers."):
        return {"module": None, "name": None}
    return {"module": tokenizer_class.__module__, "name": tokenizer_class.__qualname__}


def import_class(ref: dict) -> type | None:
    """The class `ref` names (importing its module only), or None when it names none."""
    if ref["module"] is None:
        return None
    if not ref["module"].startswith("transformers."):
        raise ValueError(f"not a transformers class: {ref}")
    return getattr(importlib.import_module(ref["module"]), ref["name"])


def _auto_tokenizer(path: str):
    from transformers import AutoTokenizer  # imports torch (through the config classes)

    return AutoTokenizer.from_pretrained(path)
