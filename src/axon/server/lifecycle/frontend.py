"""A served model's frontend files, read in the HTTP process: its tokenizer, its chat template
(the model's own or an override) and the sampling defaults of generation_config.json."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from axon.config import EngineConfig
from axon.tokenizer.chat_template import ChatTemplate, resolve_chat_template, warn_chatml_fallback
from axon.tokenizer.loading import load_tokenizer

logger = logging.getLogger(__name__)

_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path: str) -> dict:
    """Sampling defaults from generation_config.json (only the keys it sets)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {k: data[k] for k in _GENERATION_DEFAULT_KEYS if data.get(k) is not None}


def model_template(model_id: str, tokenizer_path: str, tokenizer, override) -> ChatTemplate | None:
    """The model's chat template: `override` (template text), else the model's own (see
    resolve_chat_template), also set on the tokenizer so that whatever reads
    `tokenizer.chat_template` (the output parsers) sees the one in use. Reads files: run it in
    a thread."""
    if tokenizer is None:
        return None
    template = override or resolve_chat_template(tokenizer_path, tokenizer)
    if template is None:
        warn_chatml_fallback(tokenizer, model_id)
    else:
        tokenizer.chat_template = template
    return template


def load_frontend(model_id: str, config: EngineConfig, override) -> tuple:
    """(tokenizer, chat template) of the model: blocking, run in a thread."""
    started = time.monotonic()
    tokenizer_path = config.tokenizer or config.model
    tokenizer = load_tokenizer(tokenizer_path)
    template = model_template(model_id, tokenizer_path, tokenizer, override)
    logger.info("tokenizer of %s loaded in %.1f s", model_id, time.monotonic() - started)
    return tokenizer, template
