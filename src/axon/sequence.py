"""A sequence's token ids and its place in the KV cache. Pure Python: no torch here."""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass

from axon.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"


_seq_counter = itertools.count()


@dataclass
class ImageInputs:
    """A request's images, shared by its `n` samples (so the tower runs once per request).

    Tensors are opaque here (this module imports no torch): `pixel_values` [num_patches, D] and
    the M-RoPE `positions` [3, num_prompt_tokens] of the prompt, computed once at admission.
    """

    pixel_values: object
    grid_thw: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]  # (first image-token index, image-token count) per image
    image_hashes: list[bytes]  # per image: a digest of its pixels and grid
    positions: object
    mrope_delta: int  # positions past the prompt are index + mrope_delta (every row)
    embeds: object = None  # the tower's output [sum(counts), hidden], once computed
    deepstack: object = None  # Qwen3-VL: DeepStack features [L, sum(counts), hidden], likewise

    def block_extra_key(self, start: int, end: int) -> bytes:
        """The hashes of the images with tokens in [start, end): what a prefix-cache block
        covering those tokens is keyed by besides its token ids (b"" when none)."""
        return b"".join(
            digest
            for (first, count), digest in zip(self.spans, self.image_hashes)
            if first < end and first + count > start
        )


class Sequence:
    """One stream of tokens: the prompt, then everything sampled after it.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache; the scheduler
    grows it step by step (prefill chunks and decodes alike). `block_table` lists the physical KV
    blocks holding tokens `[i*block_size, (i+1)*block_size)`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        index: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        images: ImageInputs | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # which of the request's `n` samples this is
        self.sampling_params = sampling_params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # The most tokens ever computed at once: after a preemption, what lies below was
        # computed before and is only recomputed.
        self.max_num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (a re-admission after
        # preemption mostly finds the blocks the sequence computed itself: no real hit).
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full, computed blocks
        self.state_slot: int | None = None  # recurrent-state slot (hybrid models), while running
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.eos_token_ids = eos_token_ids
        # Sampling randomness is a pure function of (seed, output position): the same request
        # draws the same tokens whatever else shares its batch.
        seed = sampling_params.seed
        self.seed = seed if seed is not None else random.getrandbits(62)
        self.num_preemptions = 0
        self.last_served = 0  # the scheduler's `num_served` when it last gave this sequence tokens
        self.fork_parent: Sequence | None = None  # for n > 1: the sample whose prompt we share
        # Structured output: the grammar matcher, which has consumed exactly the output tokens
        # (kept across preemption, since recompute keeps the tokens).
        self.grammar = None
        # A thinking budget (sampling/thinking.py's ThinkingBudget), advanced with every token.
        self.thinking_budget = None
        self.images = images
        # Embedding requests: "last" or "mean" pools the prompt's final hidden states into the
        # sequence's output instead of sampling; it finishes when its prompt is computed.
        self.pooling: str | None = None
        # Speculative decoding: the drafts this step verifies after the last token (k extra
        # query tokens of its decode), and the running totals of drafted and accepted tokens.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt rows computed now must give their logprobs: the first sample of
        a request that asks for them, until its first token (after it, a recompute of the
        prompt after a preemption gives nothing: they went out with that token)."""
        asked = self.sampling_params.prompt_logprobs is not None
        return asked and self.index == 0 and self.num_output_tokens == 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def num_new_prompt_tokens(self, num_new: int) -> int:
        """How many of the next `num_new` tokens to compute are prompt tokens never computed
        before: neither prefix-cache hits (skipped) nor tokens recomputed after a preemption."""
        start = max(self.num_computed_tokens, self.max_num_computed_tokens)
        end = min(self.num_computed_tokens + num_new, self.num_prompt_tokens)
        return max(0, end - start)

    def scheduled_token_ids(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end) of this step's input: past the last token come
        the drafts to verify."""
        if end <= len(self.token_ids) or not self.spec_token_ids:
            return self.token_ids[start:end]
        return (self.token_ids + self.spec_token_ids)[start:end]

    def block_token_ids(self, block_index: int, block_size: int) -> list[int]:
        start = block_index * block_size
        return self.token_ids[start : start + block_size]

    def block_extra_key(self, block_index: int, block_size: int) -> bytes:
        """What besides its token ids keys block `block_index` in the prefix cache: the hashes
        of the images it covers, so two different images never share a block."""
        if self.images is None:
            return b""
        start = block_index * block_size
        return self.images.block_extra_key(start, start + block_size)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
