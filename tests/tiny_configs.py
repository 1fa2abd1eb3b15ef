"""Every tiny model config of the suite, in one place: the sizes, layer schedules and token ids
the model, engine, server, parser and GGUF tests build their random checkpoints from. The
builders and transformers oracles stay beside their tests (tests/model/tiny_models.py,
tests/model/qwen3_5_tiny.py, the fixtures of each file); a value changed here changes what those
tests compare, so each config keeps what its users rely on (said next to it).

Plain dicts, and functions importing transformers only when called: the HTTP tests' conftest
imports this module without paying for torch.
"""

from __future__ import annotations

# ---- dense families (tests/model/tiny_models.py) ----------------------------------------------

ARCHS = ("qwen3", "llama", "qwen2", "gemma3_text")
VOCAB_SIZE = 384
SEED = 1234
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
GEMMA3_SLIDING_WINDOW = 8

# Shared by every family: GQA with 4 query heads over 2 KV heads.
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def make_config(arch: str):
    """Return the tiny transformers config for `arch` (one of ARCHS)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "qwen3":
        return Qwen3Config(
            **_COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            head_dim=32,  # != hidden / heads, as in real Qwen3
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "llama":
        return LlamaConfig(
            **_COMMON,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        )
    if arch == "qwen2":
        return Qwen2Config(
            **_COMMON,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "gemma3_text":
        return Gemma3TextConfig(
            **_COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,  # != head_dim: the scale is 24 ** -0.5, not 16 ** -0.5
            sliding_window=GEMMA3_SLIDING_WINDOW,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            tie_word_embeddings=True,
        )
    raise ValueError(f"unknown test arch {arch!r}; expected one of {ARCHS}")


# ---- Qwen3.5 (tests/model/qwen3_5_tiny.py) ----------------------------------------------------

QWEN3_5_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
QWEN3_5_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=QWEN3_5_LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)
QWEN3_5_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)
# The image tests' text model: two full-attention layers and a wider, faster rotary than
# QWEN3_5_TEXT's, so that wrong M-RoPE positions change the greedy tokens.
QWEN3_5_IMAGES_TEXT = {
    **QWEN3_5_TEXT,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}

# ---- Qwen3-VL (tests/model/test_qwen3_vl.py, test_qwen3_5_serve.py) ---------------------------

QWEN3_VL_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    # A fast rotary with every row driving some frequencies: wrong positions change tokens.
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
)
QWEN3_VL_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
)
# The image processor of the served and engine image checkpoints (patch 4, merge 2).
PREPROCESSOR = {
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 12},  # 4..12 LM tokens
    "image_mean": [0.5, 0.45, 0.4],
    "image_std": [0.25, 0.26, 0.27],
    "resample": 3,
}

# ---- the vision towers alone (tests/model/test_qwen3_5_vision.py) -----------------------------

TOWER_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=48,
    num_position_embeddings=49,
)
TOWER_TEXT = dict(
    vocab_size=128,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=24,
)

# ---- mixture of experts (tests/model/test_moe.py, engine/test_tensor_parallel_moe.py) ---------

NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 32
_MOE_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=NUM_EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=EXPERT_WIDTH,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def moe_config(arch: str):
    """The tiny config of `arch`: "qwen3_moe" or "qwen3_5_moe_text"."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":  # sparse, dense, sparse; top-k weights not renormalised
        return Qwen3MoeConfig(
            **_MOE_COMMON,
            intermediate_size=96,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    return Qwen3_5MoeTextConfig(
        **_MOE_COMMON,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    )


# ---- served checkpoints (tests/server/conftest.py, tests/parsers/conftest.py) -----------------

# The word-level chat model every HTTP test serves.
SERVE_VOCAB_SIZE = 256
SERVE_MAX_MODEL_LEN = 2048  # room for streams long enough to still run when the test looks
SERVE_QWEN3 = dict(
    vocab_size=SERVE_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=SERVE_MAX_MODEL_LEN,
    initializer_range=0.2,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
# The parser tests' byte-level model: 256 bytes + 7 added tokens, padded; eos <|im_end|>.
BYTE_VOCAB_SIZE = 320
BYTE_EOS_ID = 256 + 2
BYTE_QWEN3 = dict(
    vocab_size=BYTE_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    eos_token_id=BYTE_EOS_ID,
)

# ---- real-vocabulary MoE for llama.cpp's converter (tests/quant/test_gguf_moe.py) -------------
# The converter insists on a real vocabulary; callers add the tokenizer's pad and eos ids.

QWEN3_VOCAB_SIZE = 151_936  # Qwen3's (padded)
QWEN3_5_VOCAB_SIZE = 248_320  # Qwen3.5's (padded)
QWEN3_MOE_GGUF = dict(
    vocab_size=QWEN3_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[],
    norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises
    max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)  # fmt: skip
# engine/test_tensor_parallel_moe.py: 64-wide experts split into whole 32-column Q8_0 blocks
# over 2 ranks, the 128-wide attention output into whole blocks over 4.
QWEN3_MOE_TP_GGUF = {**QWEN3_MOE_GGUF, "head_dim": 32, "moe_intermediate_size": 64}
# Widths 256: a Q4_K row is made of 256-wide super-blocks.
QWEN3_5_MOE_GGUF = dict(
    vocab_size=QWEN3_5_VOCAB_SIZE, hidden_size=256, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
    shared_expert_intermediate_size=128, max_position_embeddings=1024,
    initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
    rope_parameters={
        "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0], "mrope_interleaved": True,
    },
)  # fmt: skip
