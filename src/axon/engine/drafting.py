"""The drafter interface of speculative decoding, and the drafter a config asks for.

A drafter proposes tokens to follow each sequence; the engine verifies them all in the step's
one flat forward (engine/speculation.py). A drafter reconciles its own per-sequence state from
`seq.token_ids` (every accepted token so far) at each `propose`: the engine never tells it which
drafts were accepted.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from axon.engine.drafter_ngram import NgramDrafter
from axon.sequence import Sequence

if TYPE_CHECKING:
    from axon.config import EngineConfig
    from axon.runner.model_runner import ModelRunner


class Drafter(Protocol):
    # The acceptance a draft position needs to pay this step (set by the speculator before
    # each `propose`): a drafter that knows how often its positions come true cuts its drafts
    # there (n-gram lookup); the others ignore it.
    required: float

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Draft tokens to follow each sequence's `token_ids` (every accepted token so far),
        at most max_tokens[i] for seqs[i] (may be fewer or none)."""

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished / aborted / preempted sequences (a draft model frees its KV)."""


def make_drafter(config: EngineConfig, runner: ModelRunner) -> Drafter:
    """The drafter of `config.speculative_config` for the target `runner`. Raises ValueError
    when the model cannot use the method (a load error that says why)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        # By name: the draft model's drafter is built apart from this module (and loads a
        # second model's stack only when asked for).
        try:
            drafter_model = importlib.import_module("axon.engine.drafter_model")
        except ModuleNotFoundError:
            raise ValueError("speculative_config.method draft_model is not in this build") from None
        return drafter_model.DraftModelDrafter(config, runner)
    # The target's own MTP block (Qwen3.5), loaded with its weights when the config asks.
    drafter_mtp = importlib.import_module("axon.engine.drafter_mtp")
    return drafter_mtp.MtpDrafter(config, runner)
