"""Offline generation with vLLM's interface: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from collections.abc import Sequence as SequenceType

import numpy as np
import torch
from PIL import Image

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.engine.output_processor import RequestState
from axon.multimodal.placeholders import expand_image_placeholders
from axon.multimodal.processor import ImageProcessor, ProcessorConfig
from axon.outputs import RequestOutput
from axon.runner.heap import release_freed_heap
from axon.sampling_params import SamplingParams
from axon.tokenizer.loading import load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **engine_args):
        """Loads `model`. `engine_args`: the settings of axon/settings.py that LLM takes (vLLM's
        names: max_model_len, kv_cache_memory="2G", ...); an unknown name or a bad value is a
        ValueError, raised before anything loads."""
        self.config = EngineConfig.from_kwargs(str(model), tokenizer=tokenizer, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        release_freed_heap()  # the load's freed temporaries would otherwise stay resident
        self._request_counter = itertools.count()
        self._image_processor: ImageProcessor | None = None

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
        images = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            ids, images = self._images(ids, prompt["multi_modal_data"])
        request_id = str(next(self._request_counter))
        self.engine.add_request(request_id, ids, params, images=images)
        return RequestState(request_id, text, ids, params, self.tokenizer)

    # ---- images -----------------------------------------------------------------------------

    def _images(self, ids: list[int], data: dict) -> tuple[list[int], dict | None]:
        """(prompt ids with each `<|image_pad|>` expanded to its image's token count, the
        engine's image inputs) for vLLM's `multi_modal_data` {"image": [PIL images]}."""
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data supports only 'image', got {unknown}")
        pictures = data.get("image") or []
        if not isinstance(pictures, list | tuple):
            pictures = [pictures]
        if not pictures:
            return ids, None
        if getattr(self.engine.runner.model, "visual", None) is None:
            raise ValueError("this model has no vision tower loaded: images are not supported")
        if len(pictures) > self.config.max_images_per_prompt:
            raise ValueError(
                f"{len(pictures)} images in one prompt; max_images_per_prompt is "
                f"{self.config.max_images_per_prompt}"
            )
        if not all(isinstance(picture, Image.Image) for picture in pictures):
            raise ValueError("multi_modal_data images must be PIL images")
        processed = [
            self.image_processor(p if p.mode == "RGB" else p.convert("RGB")) for p in pictures
        ]
        image_token_id = int(self.engine.runner.hf_config.image_token_id)
        ids = expand_image_placeholders(ids, [p.num_tokens for p in processed], image_token_id)
        pixel_values = torch.from_numpy(np.concatenate([p.pixel_values for p in processed]))
        return ids, {"pixel_values": pixel_values, "grid_thw": [p.grid_thw for p in processed]}

    @property
    def image_processor(self) -> ImageProcessor:
        """The checkpoint's preprocessor (preprocessor_config.json) under the engine's image
        limits, made on first use."""
        if self._image_processor is None:
            config = self.config
            processor = ProcessorConfig.for_engine(
                config.model, config.max_image_pixels, config.image_profile
            )
            self._image_processor = ImageProcessor(processor)
        return self._image_processor

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
