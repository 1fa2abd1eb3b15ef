"""Qwen3-VL (`qwen3_vl`): the Qwen3 text stack with interleaved M-RoPE, plus the vision tower
of `qwen3_5_vision` with DeepStack.

The text model is Qwen3 (q/k RMSNorms, full rotary) whose rotary is M-RoPE over the whole head,
always interleaved (transformers ignores `mrope_interleaved` for this family). DeepStack: the
tower returns, beside its main output, one LM-width feature per `deepstack_visual_indexes`
block; feature i is added to the hidden states of the image-token rows right after LM layer i
(transformers' `Qwen3VLTextModel._deepstack_process`), for i < len(features). The main output
replaces the image tokens' embeddings, as for Qwen3.5.

Checkpoint names as transformers writes them: `model.language_model.*` is the text model,
`model.visual.*` the tower (skipped, with its memory, when vision is disabled), `lm_head.*`.
Tying is decided by the top-level config, as in transformers.
"""

from __future__ import annotations

import torch

from axon.layers.rotary import MRotaryEmbedding
from axon.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from axon.models.qwen3 import Qwen3Attention
from axon.models.qwen3_5_vision import Qwen3_5VisionTower
from axon.models.utils import rope_params_of

# transformers' Qwen3VLTextRotaryEmbedding falls back to this when the config has none.
DEFAULT_MROPE_SECTION = (24, 20, 20)


class Qwen3VLAttention(Qwen3Attention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        params = rope_params_of(config)
        section = params.get("mrope_section") or DEFAULT_MROPE_SECTION
        self.rotary_emb = MRotaryEmbedding(
            self.head_dim, self.head_dim, config.max_position_embeddings, params, section, True
        )


class Qwen3VLDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3VLAttention


class Qwen3VLTextModel(LlamaModel):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        deepstack_rows: torch.Tensor | None = None,
        deepstack_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]. `deepstack_embeds` [L, I, hidden] is added to rows
        `deepstack_rows` [I] after layers 0 .. L-1; without it, LlamaModel's forward."""
        if deepstack_embeds is None:
            return super().forward(input_ids, positions, inputs_embeds)
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for index, layer in enumerate(self.layers):
            hidden = layer(positions, hidden)
            if index < len(deepstack_embeds):
                # Out of place: one add per row, the same fp result as transformers' scatter.
                features = deepstack_embeds[index].to(hidden.dtype)
                hidden = hidden.index_add(0, deepstack_rows, features)
        return self.norm(hidden)


class Qwen3VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen3-VL with its vision tower (`visual`, from `model.visual.*`) when `enable_vision`;
    otherwise the text model alone."""

    model_cls = Qwen3VLTextModel
    layer_cls = Qwen3VLDecoderLayer
    supports_vision = True
    checkpoint_prefixes = {"model.language_model.": "model."}
    ignored_checkpoint_prefixes = ("model.visual.",)

    def __init__(self, config, enable_vision: bool = True):
        tied = bool(getattr(config, "tie_word_embeddings", False))
        text_config = config.get_text_config()
        text_config.tie_word_embeddings = tied
        super().__init__(text_config)
        self.tie_word_embeddings = tied
        self.visual = None
        vision_config = getattr(config, "vision_config", None)
        if enable_vision and vision_config is not None:
            self.visual = Qwen3_5VisionTower(vision_config)
            self.checkpoint_prefixes = {**self.checkpoint_prefixes, "model.visual.": "visual."}
            self.ignored_checkpoint_prefixes = ()
            self.image_token_id = int(config.image_token_id)
            self.vision_start_token_id = int(config.vision_start_token_id)
            self.spatial_merge_size = int(vision_config.spatial_merge_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        deepstack_rows: torch.Tensor | None = None,
        deepstack_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds, deepstack_rows, deepstack_embeds)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """The tower's main output [num_merged_tokens, hidden], images in `grid_thw` order.
        Raises ValueError without a tower."""
        return self.encode_images_with_deepstack(pixel_values, grid_thw)[0]

    def encode_images_with_deepstack(
        self, pixel_values: torch.Tensor, grid_thw
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tower's main output [N, hidden], its DeepStack features [L, N, hidden], None
        when the config lists no DeepStack blocks). Raises ValueError without a tower."""
        if self.visual is None:
            raise ValueError("this model has no vision tower loaded (text-only)")
        embeds, deepstack = self.visual(pixel_values, grid_thw)
        return embeds, torch.stack(deepstack) if deepstack else None
