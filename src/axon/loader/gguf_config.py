"""A model config built from a GGUF file's metadata."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gguf import GGUFReader

from axon.loader.gguf import _MODEL_TYPES, architecture, field_value, num_text_layers
from axon.loader.light_config import LightConfig, build_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The transformers config class of each model type, which build_config restates: the tests
# compare the two (tests/unit/test_light_config.py).
CONFIG_CLASSES = {
    "llama": ("llama.configuration_llama", "LlamaConfig"),
    "qwen2": ("qwen2.configuration_qwen2", "Qwen2Config"),
    "qwen3": ("qwen3.configuration_qwen3", "Qwen3Config"),
    "gemma3_text": ("gemma3.configuration_gemma3", "Gemma3TextConfig"),
    "qwen3_5_text": ("qwen3_5.configuration_qwen3_5", "Qwen3_5TextConfig"),
    "qwen3_moe": ("qwen3_moe.configuration_qwen3_moe", "Qwen3MoeConfig"),
    "qwen3_5_moe_text": ("qwen3_5_moe.configuration_qwen3_5_moe", "Qwen3_5MoeTextConfig"),
}

GEMMA3_SWA_PATTERN = 6  # llama.cpp's default: five sliding layers, then one global
GEMMA3_SWA_ROPE_BASE = 10_000.0


def gguf_to_hf_config(reader: GGUFReader) -> LightConfig:
    """The config (model_type one of llama, qwen2, qwen3, gemma3_text, qwen3_5_text,
    qwen3_moe, qwen3_5_moe_text) of a GGUF file: what transformers' class would hold."""
    model_type, kwargs = gguf_config_kwargs(reader)
    return build_config(model_type, kwargs)


def gguf_config_kwargs(reader: GGUFReader) -> tuple[str, dict]:
    """(model_type, the keyword arguments of its config class) read from a GGUF file."""
    arch = architecture(reader)

    def get(key: str, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    kwargs = dict(
        num_hidden_layers=num_text_layers(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0)),  # absent: no dense MLP (MoE)
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 4096)),
        vocab_size=_num_tokens(reader),
        tie_word_embeddings="output.weight" not in names,
        rope_parameters=_rope_parameters(reader, arch),
        **_special_ids(reader),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(reader, kwargs))
    if arch in ("qwen35", "qwen35moe"):
        kwargs.update(_qwen35_kwargs(reader, arch, kwargs))
        if get("nextn_predict_layers", 0):  # llama.cpp's name for the MTP block's layers
            kwargs["mtp_num_hidden_layers"] = int(get("nextn_predict_layers"))
    if arch in ("qwen3moe", "qwen35moe"):
        kwargs.update(_moe_kwargs(reader, arch, names, kwargs["num_hidden_layers"]))
    return _MODEL_TYPES[arch], kwargs


def config_class(model_type: str) -> type[PretrainedConfig]:
    """The transformers config class of `model_type` (what AutoConfig.for_model would make);
    the tests' oracle for build_config."""
    module, name = CONFIG_CLASSES[model_type]
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def _num_tokens(reader: GGUFReader) -> int:
    """The vocabulary's size, without decoding its strings (262k of them for gemma-3): a string
    array's field has one data index per element, in gguf-py's reader and ours alike."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens: its vocabulary size is unknown")
    return len(field.data)


def _rope_parameters(reader: GGUFReader, arch: str) -> dict:
    theta = float(field_value(reader, f"{arch}.rope.freq_base", 10_000.0))
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF rope_freqs (llama3-style rope scaling) is not supported yet")
    scaling = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        factor = float(field_value(reader, f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}; supported: none, linear")


def _special_ids(reader: GGUFReader) -> dict:
    ids = {}
    for key, name in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("padding", "pad_token_id"),
    ):
        value = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            ids[name] = int(value)
    return ids


def _gemma3_kwargs(reader: GGUFReader, kwargs: dict) -> dict:
    num_layers, head_dim = kwargs["num_hidden_layers"], kwargs["head_dim"]
    window = field_value(reader, "gemma3.attention.sliding_window")
    out: dict = {"query_pre_attn_scalar": head_dim, "sliding_window": window}
    if num_layers == 62:  # llama.cpp: Gemma3 27B scales by hidden / heads, not head_dim
        out["query_pre_attn_scalar"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    cap = field_value(reader, "gemma3.final_logit_softcapping")
    out["final_logit_softcapping"] = None if cap is None else float(cap)
    if not window:
        out["layer_types"] = ["full_attention"] * num_layers
        return out
    pattern = field_value(reader, "gemma3.attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        sliding = [bool(v) for v in pattern]
    else:
        sliding = [(i % int(pattern)) < int(pattern) - 1 for i in range(num_layers)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    local = float(field_value(reader, "gemma3.rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE))
    out["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
        "full_attention": kwargs["rope_parameters"],
    }
    return out


def _qwen35_kwargs(reader: GGUFReader, arch: str, kwargs: dict) -> dict:
    """Qwen3.5's (and Qwen3.5-MoE's) Gated DeltaNet sizes, layer schedule and partial M-RoPE
    (llama.cpp's names: `ssm.group_count` key heads, `ssm.time_step_rank` value heads,
    `ssm.state_size` the key head dim, `ssm.inner_size` all value heads' width)."""

    def get(key: str, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    num_layers, head_dim = kwargs["num_hidden_layers"], kwargs["head_dim"]
    num_v_heads = int(get("ssm.time_step_rank"))
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:  # llama.cpp's default: every `interval`-th layer is full attention
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    rope = dict(kwargs["rope_parameters"])
    rope["partial_rotary_factor"] = int(get("rope.dimension_count", head_dim)) / head_dim
    rope["mrope_section"] = [int(n) for n in get("rope.dimension_sections", [11, 11, 10])[:3]]
    rope["mrope_interleaved"] = True  # Qwen3.5 always interleaves; GGUF does not say
    return {
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": num_v_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // num_v_heads,
        "layer_types": [
            "linear_attention" if r else "full_attention" for r in recurrent[:num_layers]
        ],
        "rope_parameters": rope,
        # The converter reorders the GDN value heads from HF's grouped order to tiled.
        "linear_value_head_order": "tiled",
    }


def _moe_kwargs(reader: GGUFReader, arch: str, names: set[str], num_layers: int) -> dict:
    """Expert counts and widths. `qwen3moe`: a layer without `ffn_gate_exps` is dense
    (`mlp_only_layers`), and llama.cpp always renormalises the top-k weights (`norm_topk_prob`).
    `qwen35moe`: every layer is sparse, with a shared expert."""

    def get(key: str, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    out = {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
    }
    if arch == "qwen35moe":
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
        return out
    sparse = [f"blk.{i}.ffn_gate_exps.weight" in names for i in range(num_layers)]
    out["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    out["decoder_sparse_step"] = 1
    out["mlp_only_layers"] = [i for i, is_sparse in enumerate(sparse) if not is_sparse]
    return out
