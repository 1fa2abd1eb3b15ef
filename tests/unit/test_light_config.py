"""The light config reader (axon/loader/light_config.py) against transformers' config classes:
attribute by attribute, on every tiny config of the suite (written by transformers and read
back), on config.json files in the older shapes real checkpoints have, and on the keyword
arguments a GGUF file's metadata gives."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from axon.loader import load_hf_config
from axon.loader.gguf_config import CONFIG_CLASSES, config_class
from axon.loader.light_config import (
    LightConfig,
    build_config,
    generation_eos_token_id,
)
from tiny_configs import (
    ARCHS,
    BYTE_QWEN3,
    QWEN3_5_IMAGES_TEXT,
    QWEN3_5_MOE_GGUF,
    QWEN3_5_TEXT,
    QWEN3_5_VISION,
    QWEN3_MOE_GGUF,
    QWEN3_MOE_TP_GGUF,
    QWEN3_VL_TEXT,
    QWEN3_VL_VISION,
    SERVE_QWEN3,
    TOWER_TEXT,
    TOWER_VISION,
    make_config,
    moe_config,
)

# PreTrainedConfig's own bookkeeping (labels, output switches, attention backend): no model,
# runner or loader of axon reads them, and the light config leaves them out.
TRANSFORMERS_ONLY = frozenset(
    (
        "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
        "id2label", "label2id", "problem_type", "num_labels", "_name_or_path", "_output_attentions",
        "_attn_implementation_internal", "_experts_implementation_internal", "_post_init_done",
        "ignore_keys_at_rope_validation"
    )
)  # fmt: skip
# What axon reads with getattr and a default: absent must stay absent.
OPTIONAL_READS = (
    "attention_bias", "attn_logit_softcapping", "decoder_sparse_step", "final_logit_softcapping",
    "head_dim", "hidden_activation", "layer_types", "linear_value_head_order", "mlp_bias",
    "mlp_only_layers", "partial_rotary_factor", "rope_parameters", "rope_scaling", "rope_theta",
    "sliding_window", "tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id",
    "vision_config", "text_config", "image_token_id", "vision_start_token_id",
    "deepstack_visual_indexes",
)  # fmt: skip


ABSENT = object()


def _value(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def assert_same(light: LightConfig, reference, nested: bool = True) -> None:
    """Every attribute of either side (less transformers' bookkeeping) has the same value;
    `nested=False` leaves the sub-configs to their own comparison."""
    assert light.model_type == reference.model_type
    names = set(light.__dict__) | {f.name for f in dataclasses.fields(reference)}
    names |= {n for n in reference.__dict__ if not n.startswith("__")}
    if not nested:
        names -= {"text_config", "vision_config"}
    differ = [
        f"{name}: {getattr(light, name, '<absent>')!r} != {getattr(reference, name, '<absent>')!r}"
        for name in sorted(names - TRANSFORMERS_ONLY)
        if _value(getattr(light, name, ABSENT)) != _value(getattr(reference, name, ABSENT))
    ]
    assert not differ, "; ".join(differ)
    for name in OPTIONAL_READS:
        assert hasattr(light, name) == hasattr(reference, name), name
    if nested:
        assert light.get_text_config() is light


def _tiny_configs():
    """(label, transformers config) for every text config of tests/tiny_configs.py."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

    yield from ((arch, make_config(arch)) for arch in ARCHS)
    yield from ((arch, moe_config(arch)) for arch in ("qwen3_moe", "qwen3_5_moe_text"))
    yield "qwen3_5", Qwen3_5TextConfig(**copy.deepcopy(QWEN3_5_TEXT))
    yield "qwen3_5_images", Qwen3_5TextConfig(**copy.deepcopy(QWEN3_5_IMAGES_TEXT))
    yield "serve", Qwen3Config(**SERVE_QWEN3)
    yield "byte", Qwen3Config(**BYTE_QWEN3)
    yield "qwen3_moe_gguf", Qwen3MoeConfig(**copy.deepcopy(QWEN3_MOE_GGUF))
    yield "qwen3_moe_tp_gguf", Qwen3MoeConfig(**copy.deepcopy(QWEN3_MOE_TP_GGUF))
    yield "qwen3_5_moe_gguf", Qwen3_5MoeTextConfig(**copy.deepcopy(QWEN3_5_MOE_GGUF))


TINY = list(_tiny_configs())


@pytest.mark.parametrize(("label", "config"), TINY, ids=[label for label, _ in TINY])
def test_tiny_config_json_reads_as_transformers_does(tmp_path, label, config):
    from transformers import AutoConfig

    config.save_pretrained(tmp_path)
    light = load_hf_config(str(tmp_path))
    assert isinstance(light, LightConfig)
    assert_same(light, AutoConfig.from_pretrained(tmp_path))


# config.json as checkpoints of each family write it (transformers 4's keys: rope_theta,
# rope_scaling, torch_dtype, Gemma 3's rope_local_base_freq and sliding_window_pattern).
_OLDER_SHAPES = {
    "llama3": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        torch_dtype="bfloat16", tie_word_embeddings=True, vocab_size=384, mlp_bias=False,
        bos_token_id=1, eos_token_id=[1, 2], use_cache=True, transformers_version="4.45.0",
    ),
    "llama_linear": dict(
        model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
        rope_scaling={"type": "linear", "factor": 2.0}, max_length=4096, temperature=0.6,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, rope_scaling=None,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21,
        torch_dtype="bfloat16", attention_dropout=0.0,
    ),
    "qwen2_window": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        use_sliding_window=True, sliding_window=16, max_window_layers=2,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
        rope_scaling=None, sliding_window=None, use_sliding_window=False, max_window_layers=28,
        torch_dtype="bfloat16", tie_word_embeddings=True, attention_bias=False,
    ),
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window=512,
        sliding_window_pattern=6, rope_scaling={"factor": 8.0, "rope_type": "linear"},
        final_logit_softcapping=None, attn_logit_softcapping=None, torch_dtype="bfloat16",
    ),
    "gemma3_layer_types": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6, rope_scaling=None,
    ),
    "qwen3_5_text": dict(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, full_attention_interval=4,
        partial_rotary_factor=0.25, rope_theta=1e7, layer_types=None,
    ),
    "qwen3_5_moe_text": dict(
        model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [1, 1, 0],
                         "mrope_interleaved": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("label", sorted(_OLDER_SHAPES))
def test_older_config_json_shapes_read_as_transformers_does(tmp_path, label):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(_OLDER_SHAPES[label]))
    light = load_hf_config(str(tmp_path))
    assert isinstance(light, LightConfig)
    assert_same(light, AutoConfig.from_pretrained(tmp_path))


def _gguf_kwargs(label: str) -> tuple[str, dict]:
    """Keyword arguments shaped as gguf_config_kwargs gives them, for each GGUF model type."""
    common = dict(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=2048,
        vocab_size=384, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    rope = common["rope_parameters"]
    extra = {
        "llama": dict(attention_bias=False),
        "qwen2": {},
        "qwen3": dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}),
        "gemma3_text": dict(
            query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=None,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": rope},
        ),
        "qwen3_5_text": dict(
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_value_head_dim=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters={**rope, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                             "mrope_interleaved": True},
            linear_value_head_order="tiled",
        ),
        "qwen3_moe": dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[1],
        ),
        "qwen3_5_moe_text": dict(
            intermediate_size=0, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=16,
            rope_parameters={**rope, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                             "mrope_interleaved": True},
        ),
    }[label]  # fmt: skip
    return label, {**common, **extra}


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_gguf_metadata_kwargs_build_what_transformers_builds(model_type):
    _, kwargs = _gguf_kwargs(model_type)
    reference = config_class(model_type)(**copy.deepcopy(kwargs))
    assert_same(build_config(model_type, copy.deepcopy(kwargs)), reference)


IMAGE_IDS = dict(image_token_id=7, vision_start_token_id=5, vision_end_token_id=6)


def _multimodal_configs():
    """(label, transformers config) for the suite's multimodal wrappers."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLConfig

    text = {**QWEN3_5_TEXT, "model_type": "qwen3_5_text"}
    yield "qwen3_5", Qwen3_5Config(text_config=text, vision_config=dict(QWEN3_5_VISION))
    yield (
        "qwen3_5_images",
        Qwen3_5Config(
            text_config={**QWEN3_5_IMAGES_TEXT}, vision_config=dict(QWEN3_5_VISION), **IMAGE_IDS
        ),
    )
    yield "qwen3_5_no_vision", Qwen3_5Config(text_config=text)
    yield "tower", Qwen3_5Config(text_config=dict(TOWER_TEXT), vision_config=dict(TOWER_VISION))
    moe = moe_config("qwen3_5_moe_text").to_dict()
    yield (
        "qwen3_5_moe",
        Qwen3_5MoeConfig(
            text_config=moe, vision_config=dict(QWEN3_5_VISION), tie_word_embeddings=False
        ),
    )
    yield (
        "qwen3_vl",
        Qwen3VLConfig(
            text_config=dict(QWEN3_VL_TEXT), vision_config=dict(QWEN3_VL_VISION), **IMAGE_IDS
        ),
    )
    yield "qwen3_vl_defaults", Qwen3VLConfig()


MULTIMODAL = list(_multimodal_configs())


@pytest.mark.parametrize(("label", "config"), MULTIMODAL, ids=[label for label, _ in MULTIMODAL])
def test_multimodal_config_json_reads_as_transformers_does(tmp_path, label, config):
    from transformers import AutoConfig

    config.save_pretrained(tmp_path)
    light = load_hf_config(str(tmp_path))
    reference = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(light, LightConfig)
    assert_same(light, reference, nested=False)
    assert_same(light.text_config, reference.text_config)
    assert_same(light.vision_config, reference.vision_config)
    assert light.get_text_config() is light.text_config


def test_unknown_model_types_still_come_from_transformers(tmp_path):
    from transformers import MistralConfig

    MistralConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    assert type(load_hf_config(str(tmp_path))).__name__ == "MistralConfig"


def test_light_config_survives_pickling():
    import pickle

    config = build_config("qwen3", dict(SERVE_QWEN3))
    again = pickle.loads(pickle.dumps(config))
    assert again.__dict__ == config.__dict__ and again.model_type == "qwen3"


def test_light_config_module_imports_no_transformers():
    import subprocess
    import sys

    code = "import sys, axon.loader.light_config; print('transformers' in sys.modules)"
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_file_config_is_what_transformers_builds(tmp_path, arch):
    from gguf import GGMLQuantizationType

    from axon.loader.gguf import open_gguf
    from axon.loader.gguf_config import gguf_config_kwargs, gguf_to_hf_config
    from quant.gguf_files import build_gguf_model, write_gguf

    model = build_gguf_model(arch)
    path, _ = write_gguf(model, arch, GGMLQuantizationType.Q8_0, tmp_path / "m.gguf")
    model_type, kwargs = gguf_config_kwargs(open_gguf(str(path)))
    assert_same(gguf_to_hf_config(open_gguf(str(path))), config_class(model_type)(**kwargs))


@pytest.mark.parametrize(
    "content", [None, "{}", '{"eos_token_id": 7}', '{"eos_token_id": [1, 7]}', "{not json"]
)
def test_generation_eos_is_what_generation_config_reads(tmp_path, content):
    from transformers import GenerationConfig

    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    try:
        want = GenerationConfig.from_pretrained(tmp_path).eos_token_id
    except OSError:
        want = None
    assert generation_eos_token_id(tmp_path) == want
    assert generation_eos_token_id(tmp_path / "model.gguf") is None
