"""The draft-model drafter: its proposals are the draft model's own greedy continuation (an
independent LLM of that model says which), through partial acceptance (its rollback), several
sequences of different lengths per forward, chunked catch-up; its blocks are freed; a draft
with another vocabulary is refused, saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from axon import LLM, SamplingParams
from axon.engine.drafter_model import DraftModelDrafter, vocabulary_problem
from axon.sequence import Sequence
from tests.model.tiny_models import get_tiny_model, random_prompts
from tests.tiny_configs import VOCAB_SIZE

ENGINE_ARGS = dict(dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=2 << 20)
K = 4


def draft_spec(path, k: int = K, **fields) -> SimpleNamespace:
    """What the drafter reads of a SpeculativeConfig (method draft_model)."""
    values = dict(method="draft_model", num_speculative_tokens=k, model=str(path), quant=None)
    values.update(dtype=None, activation_precision=None, **fields)
    return SimpleNamespace(**values)


@pytest.fixture(scope="module")
def target(tiny_model_root):
    return LLM(str(get_tiny_model("llama", tiny_model_root).path), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def qwen3(tiny_model_root):
    """An independent LLM of the draft model the tests draft with."""
    return LLM(str(get_tiny_model("qwen3", tiny_model_root).path), **ENGINE_ARGS)


@pytest.fixture(scope="module", params=["same", "qwen3"])
def pair(request, target, qwen3):
    """(drafter, the LLM whose greedy continuation its proposals must equal): the target's own
    model as its draft, or another architecture over the same vocabulary."""
    reference = target if request.param == "same" else qwen3
    drafter = DraftModelDrafter(
        target.config, target.engine.runner, draft_spec(reference.config.model)
    )
    yield drafter, reference
    drafter.release(list(drafter.states))


def greedy(llm: LLM, token_ids: list[int], num_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": token_ids}, params)[0].outputs[0].token_ids


def targets(lengths: tuple[int, ...], seed: int) -> list[Sequence]:
    prompts = random_prompts(lengths, seed)
    return [Sequence(f"t{i}", prompt, SamplingParams()) for i, prompt in enumerate(prompts)]


def accept(seq: Sequence, drafts: list[int], num_accepted: int) -> None:
    """What the target appends when it accepts `num_accepted` drafts: them, then its own token
    (one that differs from the next draft, as a rejection's would)."""
    seq.token_ids.extend(drafts[:num_accepted])
    bonus = 3 + (seq.num_tokens * 7) % (VOCAB_SIZE - 3)
    if num_accepted < len(drafts) and bonus == drafts[num_accepted]:
        bonus = 3 + (bonus - 2) % (VOCAB_SIZE - 3)
    seq.token_ids.append(bonus)


def assert_blocks_consistent(drafter) -> None:
    """Every state holds exactly the blocks of its computed tokens (some shared through the
    prefix cache); every other block is free or cached."""
    block_size, held = drafter.blocks.block_size, set()
    for state in drafter.states.values():
        computed = state.seq.num_computed_tokens
        assert len(state.seq.block_table) == -(-computed // block_size)
        held.update(state.seq.block_table)
    for block in drafter.blocks.blocks:
        assert block.ref_count == sum(
            state.seq.block_table.count(block.block_id) for state in drafter.states.values()
        )
    assert len(held) + drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


@pytest.mark.parametrize("lengths", [(3, 9, 22), (13,)])  # (13,): the lone-sequence decode path
def test_proposals_are_the_draft_models_greedy_tokens_through_rollbacks(pair, lengths):
    drafter, reference = pair
    seqs = targets(lengths, seed=5)
    for round_index in range(6):
        drafts = drafter.propose(seqs, [K] * len(seqs))
        for index, (seq, proposed) in enumerate(zip(seqs, drafts)):
            assert proposed == greedy(reference, seq.token_ids, K), (round_index, index)
            accept(seq, proposed, (round_index + 2 * index) % (K + 1))  # 0..K accepted
        assert_blocks_consistent(drafter)
    drafter.release(seq.seq_id for seq in seqs)


def test_chunked_catch_up_and_uneven_draft_counts(target, qwen3):
    """A token budget smaller than the prompts splits the catch-up over several forwards, and
    sequences asking for 0, 1 or K drafts share them."""
    drafter = DraftModelDrafter(target.config, target.engine.runner, draft_spec(qwen3.config.model))
    drafter.token_budget = 7
    seqs = targets((5, 17, 30, 12), seed=11)
    counts = [K, 0, 1, K]
    for round_index in range(3):
        drafts = drafter.propose(seqs, counts)
        assert [len(d) for d in drafts] == counts
        for seq, proposed in zip(seqs, drafts):
            if proposed:
                assert proposed == greedy(qwen3, seq.token_ids, len(proposed))
            accept(seq, proposed, round_index % (len(proposed) + 1))
        assert_blocks_consistent(drafter)
    assert drafter.num_forwards > 3 * K  # the first round's catch-up took several forwards


@pytest.mark.parametrize("min_confidence", [0.0, 0.05, 1.0])
def test_drafting_stops_at_an_unconfident_token(target, min_confidence):
    """With min_confidence, each proposal is the greedy one up to its first token below that
    probability: all K at 0, none at 1, prefixes of several lengths between."""
    drafter = DraftModelDrafter(
        target.config, target.engine.runner, draft_spec(target.config.model)
    )
    drafter.min_confidence = min_confidence
    seqs = targets((5, 11, 16, 8), seed=21)
    lengths = []
    for round_index in range(3):
        drafts = drafter.propose(seqs, [K] * len(seqs))
        for seq, proposed in zip(seqs, drafts):
            assert proposed == greedy(target, seq.token_ids, K)[: len(proposed)]
            lengths.append(len(proposed))
            accept(seq, proposed, round_index % (len(proposed) + 1))
        assert_blocks_consistent(drafter)
    if min_confidence in (0.0, 1.0):
        assert set(lengths) == {K if min_confidence == 0.0 else 0}
    else:  # the tiny model's probabilities straddle 0.05: some drafts stop early
        assert len(set(lengths)) > 1


def test_a_shared_prompt_is_computed_once(target):
    """The draft's blocks are prefix-cached like the target's: a second sample of the same
    prompt, and a next turn that extends a released conversation, start from its blocks."""
    drafter = DraftModelDrafter(
        target.config, target.engine.runner, draft_spec(target.config.model)
    )
    first, second = targets((23, 23), seed=4)
    second.token_ids = list(first.token_ids)
    accept(first, drafter.propose([first], [K])[0], 1)
    drafter.propose([first], [K])  # its 24 accepted tokens' 6 blocks are cached now
    assert drafter.propose([second], [K])[0] == greedy(target, second.token_ids, K)
    assert drafter.blocks.prefix_cache_hits == 20  # the prompt's 5 full blocks
    drafter.release([first.seq_id])
    follow_up = Sequence("next", first.token_ids + [7, 8, 9], SamplingParams())
    assert drafter.propose([follow_up], [K])[0] == greedy(target, follow_up.token_ids, K)
    assert drafter.blocks.prefix_cache_hits == 20 + 24  # its first 6 blocks: the first's
    assert_blocks_consistent(drafter)


def test_the_drafts_cache_holds_the_targets_tokens_and_its_drafts(target, qwen3):
    drafter = DraftModelDrafter(target.config, target.engine.runner, draft_spec(qwen3.config.model))
    plan, draft_plan = target.engine.runner.plan, drafter.runner.plan
    wanted = plan.num_tokens + target.config.max_num_seqs * (K + plan.block_size)
    assert wanted <= draft_plan.num_tokens < wanted + draft_plan.max_model_len + plan.block_size
    assert draft_plan.max_model_len == plan.max_model_len + K
    assert drafter.runner.device == target.engine.runner.device


def test_a_rolled_back_block_taken_by_another_sequence(target):
    """A lone sequence's decode inputs are kept across steps for its block table
    (decode_batch.HostBuffers): a block it rolls back and another sequence then takes must not
    stay in them when it drafts alone again."""
    drafter = DraftModelDrafter(
        target.config, target.engine.runner, draft_spec(target.config.model)
    )
    alone, other = targets((7, 5), seed=13)
    accept(alone, drafter.propose([alone], [K])[0], 0)  # its third block held drafts: freed
    # The other takes that block; one draft each: one forward of both, no lone decode step.
    drafts = drafter.propose([alone, other], [1, 1])
    accept(alone, drafts[0], 1)
    assert drafter.propose([alone], [K])[0] == greedy(target, alone.token_ids, K)


def test_release_frees_every_block(target):
    drafter = DraftModelDrafter(
        target.config, target.engine.runner, draft_spec(target.config.model)
    )
    seqs = targets((6, 19), seed=3)
    drafter.propose(seqs, [K, K])
    assert drafter.blocks.num_free_blocks < drafter.blocks.num_blocks
    drafter.release([seqs[0].seq_id, 10**9])  # an unknown id is ignored
    assert list(drafter.states) == [seqs[1].seq_id]
    assert_blocks_consistent(drafter)
    drafter.release([seqs[1].seq_id])
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks
    assert drafter.propose(seqs, [K, K])[0] == greedy(target, seqs[0].token_ids, K)  # afresh


def test_drafts_stop_at_the_drafts_context(target):
    drafter = DraftModelDrafter(
        target.config, target.engine.runner, draft_spec(target.config.model)
    )
    limit = drafter.max_model_len
    seqs = targets((limit - 2, limit + 1), seed=9)
    assert [len(d) for d in drafter.propose(seqs, [K, K])] == [3, 0]


def test_a_tensor_parallel_target_drafts_on_rank_0_unsharded(tiny_model_root):
    """With two target ranks, the draft is one whole model in rank 0's process: its layers
    built as one rank, its drafts the greedy ones of the (sharded) target's same model."""
    sharded = LLM(
        str(get_tiny_model("llama", tiny_model_root).path), tensor_parallel_size=2, **ENGINE_ARGS
    )
    try:
        runner = sharded.engine.runner
        drafter = DraftModelDrafter(sharded.config, runner, draft_spec(sharded.config.model))
        assert drafter.runner.workers is None
        sizes = {m.tp_size for m in drafter.runner.model.modules() if hasattr(m, "tp_size")}
        assert sizes == {1}
        seqs = targets((6, 14), seed=8)
        for round_index in range(2):
            drafts = drafter.propose(seqs, [K, K])
            for seq, proposed in zip(seqs, drafts):
                assert proposed == greedy(sharded, seq.token_ids, K)
                accept(seq, proposed, round_index + 1)
    finally:
        sharded.engine.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_the_engine_speculating_with_a_draft_model_gives_its_own_output(tiny_model_root, arch):
    """Through the engine (speculative_config): greedy and seeded outputs are the engine's
    without drafts, with the target's own model as its draft (every draft accepted) and with
    another model (drafts mostly rejected)."""
    pytest.importorskip("axon.speculative_config", reason="the engine's speculative decoding")
    path = str(get_tiny_model(arch, tiny_model_root).path)
    other = str(get_tiny_model("qwen3" if arch != "qwen3" else "llama", tiny_model_root).path)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((6, 19), seed=17)]
    greedy_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)

    def outputs(llm, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    plain = LLM(path, **ENGINE_ARGS)
    expected = [outputs(plain, params) for params in (greedy_params, seeded)]
    for draft in (path, other):
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
        llm = LLM(path, speculative_config=config, **ENGINE_ARGS)
        assert outputs(llm, greedy_params) == expected[0], draft
        stats = llm.engine.stats()
        assert stats["spec_num_draft_tokens"] > 0
        if draft == path:  # greedy drafts of the same model: the target's own tokens
            assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
        assert outputs(llm, seeded) == expected[1], draft


def tokenizer_with(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path):
    draft = shutil.copytree(target.config.model, tmp_path / "draft")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB_SIZE)})
    vocab["w5"], vocab["w6"] = 6, 5
    tokenizer_with(vocab).save_pretrained(draft)
    with pytest.raises(ValueError, match=r"tokenizer differs from the target's in 2 tokens"):
        DraftModelDrafter(target.config, target.engine.runner, draft_spec(draft))


def test_a_draft_with_another_vocabulary_size_is_refused(target, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    config = json.loads((Path(target.config.model) / "config.json").read_text())
    config["vocab_size"] = VOCAB_SIZE + 16
    (draft / "config.json").write_text(json.dumps(config))  # no tokenizer to compare
    with pytest.raises(ValueError, match=rf"vocabulary has {VOCAB_SIZE + 16} tokens, the target"):
        DraftModelDrafter(target.config, target.engine.runner, draft_spec(draft))


def test_vocabulary_problem():
    tokens = ["a", "b"]
    assert vocabulary_problem(2, 2, tokens, list(tokens)) is None
    assert vocabulary_problem(2, 8, tokens, list(tokens)) is None  # a padded embedding
    assert vocabulary_problem(2, 2, None, None) is None
    assert "has 3 tokens, the target's 2" in vocabulary_problem(2, 3, tokens, None)
    assert "has 3 tokens, the target's 2" in vocabulary_problem(2, 2, tokens, [*tokens, "c"])
    assert "the first id 1 ('c', the target's 'b')" in vocabulary_problem(2, 2, tokens, ["a", "c"])
