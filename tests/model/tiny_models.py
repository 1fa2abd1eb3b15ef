"""Tiny random checkpoints written by transformers, and transformers' answers on them (the oracle).

Every checkpoint is built here from a fixed seed, so a test run downloads nothing. The configs
(tests/tiny_configs.py, with the suite's other tiny configs) are small enough that the whole
model suite runs in well under a minute on 2 cores, but each one keeps what distinguishes its
family: GQA everywhere, tied (qwen3, gemma3) and untied (llama, qwen2)
embeddings, q/k/v biases (qwen2), q/k norms (qwen3, gemma3), and for gemma3 `(1 + w)` RMSNorms,
a scaled embedding, `query_pre_attn_scalar != head_dim`, and sliding-window layers with their own
RoPE theta next to full-attention ones.

Random models give near-tied logits, which makes greedy comparisons flaky: a 1e-6 difference in
the engine flips the argmax. `initializer_range` is therefore large, and `TinyModel.greedy` records
the top-1/top-2 logit gap at every generated position, which the tests assert is far above fp32
noise before they compare tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    Gemma3ForCausalLM,
    GenerationConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from tiny_configs import ARCHS as ARCHS
from tiny_configs import BOS_ID, EOS_ID, PAD_ID, SEED, VOCAB_SIZE, make_config
from tiny_configs import GEMMA3_SLIDING_WINDOW as GEMMA3_SLIDING_WINDOW

NORM_NOISE = 0.2  # RMSNorm weights start at ones (or zeros for (1+w)); noise makes them count
BIAS_STD = 0.2


_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen3": Qwen3ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


@torch.no_grad()
def _perturb(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Give norms and biases random values; init leaves them constant, which hides bugs."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            noise = torch.randn(param.shape, generator=generator) * NORM_NOISE
            param.add_(noise.to(param.dtype))
        elif name.endswith(".bias"):
            param.copy_(torch.randn(param.shape, generator=generator) * BIAS_STD)


def build_model(arch: str, seed: int = SEED) -> PreTrainedModel:
    """Return a freshly initialised fp32 model for `arch` in eval mode (eager attention)."""
    torch.manual_seed(seed)
    config = make_config(arch)
    config._attn_implementation = "eager"
    model = _MODEL_CLASSES[arch](config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    if arch == "gemma3_text":
        _spread_gemma3(model)
    return model


@torch.no_grad()
def _spread_gemma3(model: PreTrainedModel) -> None:
    """Keep the tied, sqrt(hidden)-scaled embedding from dominating the residual stream.

    Otherwise the last token's own embedding wins the tied LM head and greedy decoding repeats one
    token forever, which would compare nothing. A smaller embedding with a larger final norm keeps
    the logits as large while the layers decide the next token.
    """
    model.model.embed_tokens.weight.mul_(0.1)
    model.model.norm.weight.add_(9.0)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the whole tiny vocab, so `.text` can be detokenized.

    transformers 5's AutoTokenizer swaps in Qwen2Tokenizer (byte-level) for a `qwen2` config, so
    under that arch text round-trips badly; the model tests use token-id prompts only.
    """
    specials = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<bos>": BOS_ID}
    vocab = dict(specials)
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB_SIZE)})
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def write_checkpoint(model: PreTrainedModel, path: Path, max_shard_size: str | None = None) -> Path:
    """Save `model` (safetensors, optionally sharded) plus a tokenizer under `path`; return it."""
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    build_tokenizer().save_pretrained(path)
    return path


@dataclass
class GreedyReference:
    """transformers' greedy continuation of one prompt."""

    token_ids: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position

    @property
    def min_margin(self) -> float:
        return min(self.margins)


@dataclass
class TinyModel:
    """One arch's checkpoint on disk, its transformers model, and cached oracle answers."""

    arch: str
    path: Path
    hf_model: PreTrainedModel
    _logits: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    _greedy: dict[tuple[tuple[int, ...], int], GreedyReference] = field(
        default_factory=dict, repr=False
    )

    @property
    def config(self) -> PretrainedConfig:
        return self.hf_model.config

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes one token takes across all layers (every layer holds a full KV slot)."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        num_layers = config.num_hidden_layers
        return 2 * num_layers * config.num_key_value_heads * head_dim * dtype_bytes

    @torch.no_grad()
    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        """Return transformers' fp32 logits [V] at the last position of `prompt` (no padding)."""
        key = tuple(prompt)
        if key not in self._logits:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            self._logits[key] = self.hf_model(input_ids).logits[0, -1].float().clone()
        return self._logits[key]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> GreedyReference:
        """Return transformers' greedy continuation of `prompt`, never stopping early."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = self._run_greedy(prompt, max_new_tokens)
        return self._greedy[key]

    def _run_greedy(self, prompt: list[int], max_new_tokens: int) -> GreedyReference:
        # The engine runs with ignore_eos=True, so transformers must not stop at EOS either.
        # generate() fills every None in the config it is given from the model's own
        # generation_config (which names EOS), so that one is swapped out for the call;
        # min_new_tokens is no substitute: it masks the EOS logit, changing the argmax.
        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=PAD_ID,
            output_scores=True,
            return_dict_in_generate=True,
        )
        input_ids = torch.tensor([prompt], dtype=torch.long)
        saved, self.hf_model.generation_config = self.hf_model.generation_config, generation_config
        try:
            out = self.hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids))
        finally:
            self.hf_model.generation_config = saved
        token_ids = out.sequences[0, len(prompt) :].tolist()
        assert len(token_ids) == max_new_tokens, "transformers stopped early"
        scores = torch.cat(out.scores, dim=0).float()  # [steps, V]
        top2 = scores.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        return GreedyReference(token_ids=token_ids, margins=margins)


_CACHE: dict[tuple[str, Path], TinyModel] = {}


def get_tiny_model(arch: str, root: Path) -> TinyModel:
    """Build (once per session and root) the tiny checkpoint for `arch` under `root`."""
    key = (arch, root)
    if key not in _CACHE:
        model = build_model(arch)
        path = write_checkpoint(model, root / arch)
        _CACHE[key] = TinyModel(arch=arch, path=path, hf_model=model)
    return _CACHE[key]


def random_prompt(length: int, seed: int, low: int = 3) -> list[int]:
    """Return `length` random token ids in [low, VOCAB_SIZE), skipping the special ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB_SIZE, (length,), generator=generator).tolist()


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Return one random prompt per length, each from its own derived seed."""
    return [random_prompt(length, seed * 1000 + i) for i, length in enumerate(lengths)]


def engine_kwargs(
    tiny: TinyModel,
    *,
    block_size: int = 16,
    kv_cache_blocks: int = 256,
    **overrides,
) -> dict:
    """Return `LLM(...)` keyword arguments for `tiny`: fp32, prefix caching on, and a KV cache of
    exactly `kv_cache_blocks` blocks (sized here, so tests never depend on host memory)."""
    kwargs = dict(
        model=str(tiny.path),
        dtype="float32",
        block_size=block_size,
        max_model_len=512,
        max_num_seqs=8,
        enable_prefix_caching=True,
        kv_cache_memory=kv_cache_blocks * block_size * tiny.kv_bytes_per_token(),
    )
    kwargs.update(overrides)
    return kwargs
