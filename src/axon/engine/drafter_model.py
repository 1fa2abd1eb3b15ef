"""A draft model for speculative decoding: a second, small ModelRunner in the engine process,
with its own paged KV cache and block bookkeeping, drafting greedily for every sequence at once.

Each `propose` first reconciles the draft's cache with every sequence's accepted tokens: what it
computed past the longest prefix still equal to `seq.token_ids` (the drafts the target
rejected) is rolled back, its trailing blocks freed. It then computes what it is missing (the
catch-up: usually the accepted drafts and the target's bonus token, the whole prompt the first
time) and drafts k tokens with k - 1 more decode steps, all sequences in one flat batch per
forward, as the target's steps are. Tokens are the draft's argmax: a one-hot proposal, which
the target's accept-while-equal verification turns into the standard accept / resample rule
(no q(d) needed, and greedy or seeded output stays the target's token for token).

Its blocks are prefix-cached as the target's are (a shared prompt or a chat's next turn finds
its draft KV), but only blocks of accepted tokens: a block holding drafts is never cached.

The draft runs unsharded on rank 0's device (tensor parallelism shards the target only: a
draft is small). Its cache holds as many tokens as the target's plan, plus each sequence's
drafts (`draft_engine_config`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from axon.batch import SchedulerOutput
from axon.cache.block_manager import BlockManager
from axon.config import EngineConfig
from axon.loader import is_gguf, load_hf_config
from axon.loader.gguf import open_gguf, release_freed_memory
from axon.runner.model_runner import ModelRunner
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence
from axon.tokenizer.loading import load_tokenizer

logger = logging.getLogger(__name__)

# The draft's sequences never sample through the engine's sampler: argmax of its logits.
_DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
_UNSURE = -1  # a forward's "token" for a sequence whose greedy token is below min_confidence


@dataclasses.dataclass
class _DraftState:
    """The draft's copy of one target sequence: its own token list (the target's tokens, then
    this propose's drafts), computed count and block table."""

    seq: Sequence
    synced: int = 0  # leading tokens copied from the target at the last propose


class DraftModelDrafter:
    """Drafts for the target's sequences (keyed by seq_id) with a draft model it loads."""

    required = 0.0  # not used: its drafts are never cut (the drafter's cost d is counted)

    def __init__(self, config: EngineConfig, target: ModelRunner, spec=None):
        """Load the draft model of `spec` (default `config.speculative_config`, method
        draft_model) beside the `target` runner of `config`. Raises ValueError, saying why,
        for a draft whose vocabulary differs from the target's or that cannot be a draft."""
        spec = spec if spec is not None else config.speculative_config
        self.runner, self.vocab_size = load_draft(config, target, spec)
        plan = self.runner.plan
        # The target's prefix caching, for the draft's blocks too: a chat's next turn, a shared
        # system prompt or the n samples of a request find their prompt's draft KV computed.
        caching = config.enable_prefix_caching
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, enable_prefix_caching=caching)
        self.max_model_len = plan.max_model_len
        self.token_budget = config.max_num_batched_tokens  # a longer catch-up is chunked
        # Drafting stops at a token the draft gives less than this probability (llama.cpp's
        # --draft-p-min): an unlikely draft is mostly rejected, and costs a draft forward and a
        # verify row. None drafts all k.
        self.min_confidence: float | None = None
        self.states: dict[int, _DraftState] = {}
        self.num_forwards = 0  # the draft's forwards so far: what proposing cost

    # ---- the Drafter protocol ---------------------------------------------------------------

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] greedy draft tokens to follow seqs[i].token_ids (fewer where the
        draft's context or its cache runs out)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        active: list[tuple[int, _DraftState, int]] = []  # (index in seqs, state, tokens wanted)
        for index, (seq, wanted) in enumerate(zip(seqs, max_tokens)):
            if wanted <= 0:
                continue
            state = self._sync(seq)
            wanted = self._reserve(state.seq, wanted)
            if wanted > 0:
                active.append((index, state, wanted))
        while active:
            out = self._schedule([state for _, state, _ in active])
            tokens = self._forward(out)
            for seq, num_new in out.scheduled:
                seq.num_computed_tokens += num_new
            active = [entry for entry in active if self._take(entry, tokens, drafts)]
        return drafts

    def _take(self, entry: tuple[int, _DraftState, int], tokens: dict, drafts: list) -> bool:
        """Append the forward's token (if any) to the sequence's drafts; return whether it
        drafts on. An unconfident token ends its drafts, its spare blocks freed."""
        index, state, wanted = entry
        token = tokens.get(state.seq.seq_id)
        if token is None:
            return True  # its catch-up goes on in the next forward
        if token == _UNSURE:
            self._roll_back(state.seq, state.seq.num_computed_tokens)
            return False
        state.seq.append_token(token)
        drafts[index].append(token)
        return len(drafts[index]) < wanted

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget these target sequences, freeing their draft blocks (unknown ids ignored)."""
        for seq_id in seq_ids:
            state = self.states.pop(seq_id, None)
            if state is not None:
                self.blocks.free(state.seq)

    def close(self) -> None:
        self.runner.close()

    # ---- reconciling with the target --------------------------------------------------------

    def _sync(self, target: Sequence) -> _DraftState:
        """The draft state of `target`, its tokens now the target's and its computed ones
        rolled back to the longest common prefix (at least the last token left to compute)."""
        state = self.states.get(target.seq_id)
        if state is None:
            seq = Sequence(f"draft-{target.seq_id}", [], _DRAFT_PARAMS)
            state = self.states[target.seq_id] = _DraftState(seq)
        draft_ids, target_ids = state.seq.token_ids, target.token_ids
        common = _common_prefix(draft_ids, state.seq.num_computed_tokens, target_ids, state.synced)
        del draft_ids[common:]
        draft_ids.extend(target_ids[common:])
        state.synced = len(target_ids)
        self._roll_back(state.seq, min(common, len(target_ids) - 1))
        if not state.seq.block_table:
            self.blocks.match_prefix(state.seq)  # a new (or released) state: its prompt's blocks
        # Computed tokens are the target's now, no drafts among them: their full blocks may be
        # cached (a block holding drafts never is, so a rollback never writes into one).
        self.blocks.cache_full_blocks(state.seq)
        return state

    def _roll_back(self, seq: Sequence, num_tokens: int) -> None:
        """Keep at most the first `num_tokens` computed tokens of `seq`, freeing the blocks
        past them. A cached or shared block is never written into: a rollback into one keeps
        only the blocks before it."""
        block_size = self.blocks.block_size
        num_tokens = min(seq.num_computed_tokens, num_tokens)
        index = num_tokens // block_size  # the block that the next token is written into
        if num_tokens % block_size and not self._writable(seq.block_table[index]):
            num_tokens = index * block_size
        seq.num_computed_tokens = num_tokens
        del seq.block_hashes[num_tokens // block_size :]
        keep = -(-num_tokens // block_size)
        if keep >= len(seq.block_table):
            return
        for block_id in reversed(seq.block_table[keep:]):
            self.blocks._release(block_id)  # to the free list, or the cached ones if hashed
        # A new list, not a truncated one: the runner's decode buffers know a table by identity
        # and assume it only grows (decode_batch.HostBuffers).
        seq.block_table = seq.block_table[:keep]

    def _writable(self, block_id: int) -> bool:
        block = self.blocks.blocks[block_id]
        return block.ref_count == 1 and block.block_hash is None

    def _reserve(self, seq: Sequence, wanted: int) -> int:
        """Allocate the blocks for the catch-up and `wanted` drafts (the last one is proposed,
        not computed); return how many drafts fit the draft's context and free blocks."""
        missing = seq.num_tokens - seq.num_computed_tokens
        wanted = min(wanted, self.max_model_len - seq.num_tokens + 1)
        while wanted > 0 and not self.blocks.can_allocate(seq, missing + wanted - 1):
            wanted -= 1
        if wanted > 0:
            self.blocks.allocate(seq, missing + wanted - 1)
        return wanted

    # ---- running the draft ------------------------------------------------------------------

    def _schedule(self, states: list[_DraftState]) -> SchedulerOutput:
        """This forward's tokens: each sequence's missing ones (a catch-up chunk under the
        token budget, or one decode), earlier sequences first."""
        out = SchedulerOutput()
        budget = self.token_budget
        for state in states:
            missing = state.seq.num_tokens - state.seq.num_computed_tokens
            num_new = min(missing, budget)
            if num_new > 0:
                out.scheduled.append((state.seq, num_new))
                budget -= num_new
        return out

    def _forward(self, out: SchedulerOutput) -> dict[int, int]:
        """Run one flat batch; return {draft seq_id: its greedy next token, or _UNSURE where
        that token's probability is below `min_confidence`} for the sequences whose tokens are
        all computed by it."""
        batch = self.runner.prepare(out)
        logits = self.runner.forward_logits(batch)[:, : self.vocab_size]  # [B, V]
        self.num_forwards += 1
        if not batch.sampling_seqs:
            return {}
        best, tokens = logits.max(dim=-1)  # [B] each
        tokens = tokens.tolist()
        if self.min_confidence is not None:
            confidence = torch.exp(best - torch.logsumexp(logits, dim=-1)).tolist()
            tokens = [
                t if p >= self.min_confidence else _UNSURE for t, p in zip(tokens, confidence)
            ]
        return {seq.seq_id: token for seq, token in zip(batch.sampling_seqs, tokens)}


def _common_prefix(draft_ids: list[int], computed: int, target_ids: list[int], synced: int) -> int:
    """How many leading tokens of the draft's computed ones equal the target's. A sequence's
    tokens only grow, so the first `synced` (copied from it last time) are equal: checked on
    the last of them, else compared from the start."""
    start = min(synced, computed, len(target_ids))
    if start and draft_ids[start - 1] != target_ids[start - 1]:
        start = 0
    end = min(computed, len(target_ids))
    while start < end and draft_ids[start] == target_ids[start]:
        start += 1
    return start


# ---- loading --------------------------------------------------------------------------------


def load_draft(config: EngineConfig, target: ModelRunner, spec) -> tuple[ModelRunner, int]:
    """(the draft's runner, the vocabulary size it may propose from) for `spec`'s `model`,
    `quant`, `dtype`, `activation_precision` and `num_speculative_tokens`. The vocabulary is
    checked before the weights load."""
    path = resolve_draft_path(spec.model, getattr(spec, "quant", None))
    hf_config = load_hf_config(path)
    draft_text = hf_config.get_text_config()
    target_vocab = target.text_config.vocab_size
    vocab_size = check_vocabulary(
        config.tokenizer or config.model, target_vocab, path, draft_text.vocab_size
    )
    runner = ModelRunner(draft_engine_config(config, target, spec, path, draft_text), hf_config)
    if runner.plan.num_state_slots:
        runner.close()
        raise ValueError(
            f"draft model {path}: a hybrid (recurrent-state) model cannot be a draft yet: its "
            "state is not rolled back to the accepted tokens"
        )
    logger.info("draft model %s: %s", path, runner.plan.describe())
    return runner, vocab_size


def draft_engine_config(
    config: EngineConfig, target: ModelRunner, spec, path: str, draft_text
) -> EngineConfig:
    """The draft's EngineConfig: the target's, with the draft's file, and its dtype and
    activation precision where `spec` gives them; one rank on the target's (rank 0's) device;
    a cache sized to the target's.

    The cache holds the tokens the target's does (`plan.num_tokens`) plus k drafts and a block
    per sequence: the planner's cap, max_num_seqs x max_model_len, is set to that, and its
    budget to what those tokens take at float32, the widest KV element (the target's own
    `kv_cache_memory` is not shared out: the draft's comes on top, on the CPU filled only as
    used)."""
    plan, k = target.plan, spec.num_speculative_tokens
    max_len = min(plan.max_model_len + k, draft_text.max_position_embeddings)
    wanted_tokens = plan.num_tokens + config.max_num_seqs * (k + plan.block_size)
    blocks_per_seq = -(-max_len // plan.block_size)
    overrides = dict(
        model=path,
        dtype=getattr(spec, "dtype", None) or config.dtype,
        activation_precision=_draft_precision(config, spec, path),
        kv_cache_memory=max(wanted_tokens, max_len) * _kv_bytes_bound(draft_text),
        max_model_len=max_len,
        max_num_seqs=-(-wanted_tokens // (blocks_per_seq * plan.block_size)),
        enable_prefix_caching=False,  # the runner's setting (hybrid snapshots); blocks cache
        adaptive_threads=False,  # the target's tuner sets the thread count for both
        tensor_parallel_size=1,
        nnodes=1,
        node_rank=0,
        device=str(target.device),
        enable_vision=False,
        max_images_per_prompt=0,
        task="generate",
        tokenizer=None,
    )
    if hasattr(config, "speculative_config"):
        overrides["speculative_config"] = None  # a draft does not draft
    return dataclasses.replace(config, **overrides)


def _draft_precision(config: EngineConfig, spec, path: str) -> str:
    """The spec's activation precision, else the target's setting (auto where that is int8 and
    the draft has no GGUF weights for it)."""
    precision = getattr(spec, "activation_precision", None)
    if precision is not None:
        return precision
    if config.activation_precision == "int8" and not is_gguf(path):
        return "auto"
    return config.activation_precision


def _kv_bytes_bound(text_config) -> int:
    """K and V bytes of one token in every layer at float32: no KV dtype takes more."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * 4


def resolve_draft_path(model: str, quant: str | None) -> str:
    """The draft's model file or directory: `model` itself, or with `quant` the one GGUF file
    in directory `model` whose name contains it. Raises ValueError when there is no such file."""
    if not model:
        raise ValueError("speculative_config: method draft_model needs a 'model'")
    path = Path(model)
    if not path.exists():
        raise ValueError(f"speculative_config: draft model {model!r} does not exist")
    if quant is None:
        return str(path)
    if path.is_file():
        if quant.lower() not in path.name.lower():
            raise ValueError(f"speculative_config: quant {quant!r} is not the file {path.name}")
        return str(path)
    files = [p for p in path.glob("*.gguf") if quant.lower() in p.name.lower()]
    if len(files) != 1:
        names = sorted(p.name for p in path.glob("*.gguf"))
        raise ValueError(
            f"speculative_config: quant {quant!r} matches {len(files)} GGUF files of {model} "
            f"(need one): {names}"
        )
    return str(files[0])


def check_vocabulary(target_path: str, target_size: int, draft_path: str, draft_size: int) -> int:
    """The vocabulary size the draft may propose from; raises ValueError when the draft's
    vocabulary is not the target's: its tokenizer has another token at some id, or (without
    two tokenizers to compare) its size differs. Equal tokenizers may differ in the padding of
    the embedding (a size rounded up): the drafts come from the shared ids."""
    if is_gguf(target_path) and is_gguf(draft_path):  # the files' token lists, as llama.cpp
        target_tokens, draft_tokens = _gguf_tokens(target_path), _gguf_tokens(draft_path)
        release_freed_memory()  # the target's parsed metadata (the draft's is reused to load)
    else:
        target_tokens, draft_tokens = _tokenizer_tokens(target_path), _tokenizer_tokens(draft_path)
    problem = vocabulary_problem(target_size, draft_size, target_tokens, draft_tokens)
    if problem is not None:
        raise ValueError(f"draft model {draft_path} cannot draft for {target_path}: {problem}")
    return min(target_size, draft_size)


def _gguf_tokens(path: str) -> list[str] | None:
    """The file's tokens by id (`tokenizer.ggml.tokens`), None without them. Read from the
    metadata: building the tokenizer of a 262k vocab takes seconds."""
    field = open_gguf(path).fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    return [bytes(field.parts[index]).decode("utf-8", "replace") for index in field.data]


def _tokenizer_tokens(path: str) -> list[str | None] | None:
    """The HF tokenizer's tokens by id (None for an id it lacks), None without a tokenizer."""
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    return tokens


def vocabulary_problem(
    target_size: int,
    draft_size: int,
    target_tokens: list | None,
    draft_tokens: list | None,
) -> str | None:
    """Why a draft of `draft_size` logits and tokens `draft_tokens` (by id; None: no tokenizer)
    cannot draft for the target, or None when it can."""
    if target_tokens is None or draft_tokens is None:
        if target_size != draft_size:
            return f"its vocabulary has {draft_size} tokens, the target's {target_size}"
        return None
    if len(target_tokens) != len(draft_tokens):
        return f"its tokenizer has {len(draft_tokens)} tokens, the target's {len(target_tokens)}"
    if target_tokens == draft_tokens:
        return None
    differing = [i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)) if a != b]
    first = differing[0]
    return (
        f"its tokenizer differs from the target's in {len(differing)} tokens, the first id "
        f"{first} ({draft_tokens[first]!r}, the target's {target_tokens[first]!r})"
    )
