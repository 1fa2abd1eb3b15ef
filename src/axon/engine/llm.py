"""Offline generation with vLLM's interface: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from collections.abc import Sequence as SequenceType

import torch

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.engine.output_processor import RequestState
from axon.outputs import RequestOutput
from axon.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict


def load_tokenizer(path: str):
    """The model's HF tokenizer, or None when the directory has none (token-id prompts only)."""
    from transformers import AutoTokenizer

    from axon.loader import is_gguf
    from axon.loader.gguf_tokenizer import load_gguf_tokenizer

    try:
        return load_gguf_tokenizer(path) if is_gguf(path) else AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts work", path, exc)
        return None


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **engine_args):
        self.config = EngineConfig.from_kwargs(str(model), tokenizer=tokenizer, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self._request_counter = itertools.count()

    # ---- prompts ----------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(
                f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt)}"
            )
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer.encode(prompt)

    def _add(self, prompt: PromptType, params: SamplingParams) -> RequestState:
        text, ids = self._prompt_ids(prompt)
        request_id = str(next(self._request_counter))
        self.engine.add_request(request_id, ids, params)
        return RequestState(request_id, text, ids, params, self.tokenizer)

    # ---- the loop ---------------------------------------------------------------------------

    def _step(self, states: dict[str, RequestState]) -> None:
        """Run one engine step and apply its updates to `states`."""
        for update in self.engine.step():
            state = states.get(update.request_id)
            if state is None:
                continue
            if state.samples[update.index].add(update):
                # A stop string: free the sequence's blocks now.
                self.engine.stop_sample(update.request_id, update.index)

    def generate(
        self,
        prompts: PromptType | SequenceType[PromptType],
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        states = [self._add(p, sp) for p, sp in zip(prompts, params)]
        pending = {s.request_id: s for s in states}
        while any(not s.finished for s in states):
            self._step(pending)
        return [s.to_output() for s in states]

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield text deltas of the first sample as they are produced."""
        state = self._add(prompt, sampling_params or SamplingParams())
        sample = state.samples[0]
        try:
            while not state.finished:
                self._step({state.request_id: state})
                delta = sample.new_text()
                if delta:
                    yield delta
        finally:
            if not state.finished:
                self.engine.abort([state.request_id])

    # ---- debug and stats --------------------------------------------------------------------

    def compute_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        return self.engine.forward_logits(prompts)

    def get_stats(self) -> dict:
        return self.engine.stats()
