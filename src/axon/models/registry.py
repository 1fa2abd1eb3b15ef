"""model_type -> model class."""

from __future__ import annotations

from torch import nn

from axon.models.gemma3 import Gemma3ForCausalLM
from axon.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from axon.models.qwen3 import Qwen3ForCausalLM
from axon.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from axon.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration
from axon.models.qwen3_moe import Qwen3MoeForCausalLM
from axon.models.qwen3_vl import Qwen3VLForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "qwen3_5": Qwen3_5ForConditionalGeneration,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


def get_model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}") from None
