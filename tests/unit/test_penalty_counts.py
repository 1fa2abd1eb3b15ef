"""PenaltyCounts (persistent, incremental) against the from-scratch rebuild it replaces."""

from __future__ import annotations

import random

import torch

from axon.sampling import Sampler, SamplingMetadata
from axon.sampling.penalties import PenaltyCounts, penalty_tensors_ref
from axon.sampling.sampler import apply_penalties_
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence, SequenceStatus

CPU = torch.device("cpu")
VOCAB = 50

PENALISED = [
    SamplingParams(seed=1, repetition_penalty=1.3),
    SamplingParams(seed=2, frequency_penalty=0.6, presence_penalty=-0.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.9, presence_penalty=0.8),
    SamplingParams(seed=3, top_k=5, frequency_penalty=-0.4, repetition_penalty=1.2),
]


def running(params: SamplingParams, prompt_len: int, rng: random.Random) -> Sequence:
    # Ids up to VOCAB + 2: a tokenizer's added tokens past the logits have nothing to penalise.
    seq = Sequence("req", [rng.randrange(VOCAB + 3) for _ in range(prompt_len)], params)
    seq.status = SequenceStatus.RUNNING
    return seq


def penalised_logits(logits: torch.Tensor, penalties) -> torch.Tensor:
    out = logits.clone()
    if penalties is not None:
        apply_penalties_(out, penalties)
    return out


def test_incremental_counts_equal_the_rebuild_as_rows_join_leave_and_are_preempted() -> None:
    rng = random.Random(0)
    counts = PenaltyCounts(VOCAB, CPU)
    sampler = Sampler()
    plain = running(SamplingParams(temperature=0.0), 4, rng)
    batch = [running(PENALISED[0], 6, rng), plain, running(PENALISED[1], 3, rng)]
    for step in range(40):
        if step == 5:  # a new row joins in the middle of the batch
            batch.insert(1, running(PENALISED[2], 9, rng))
        if step == 12:  # a row is preempted (recompute keeps its tokens), and leaves the batch
            preempted = batch.pop(0)
            preempted.status, preempted.num_preemptions = SequenceStatus.WAITING, 1
        if step == 18:  # ... and resumes, at the end of the batch
            preempted.status = SequenceStatus.RUNNING
            batch.append(preempted)
        if step == 25:  # a row finishes; its slot is reused by the next one to join
            batch.pop(2).status = SequenceStatus.FINISHED
            batch.append(running(PENALISED[3], 2, rng))
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(step))
        fast = SamplingMetadata.from_sequences(batch, VOCAB, CPU, penalty_counts=counts)
        slow = SamplingMetadata.from_sequences(batch, VOCAB, CPU)
        expected = penalised_logits(logits, slow.penalties)
        assert torch.equal(penalised_logits(logits, fast.penalties), expected), step
        tokens = sampler(logits, fast).token_ids
        assert tokens == sampler(logits, slow).token_ids
        for seq, token_id in zip(batch, tokens):
            seq.append_token(token_id if step % 7 else VOCAB + 1)  # now and then an added id
    # The finished row's state is gone, its slot reused; the plain row never had one.
    assert sorted(counts.rows) == sorted(seq.seq_id for seq in batch if seq is not plain)
    assert counts.ids.shape[0] == 4
    assert plain.seq_id not in counts.rows


def test_counts_match_the_rebuild_on_long_outputs_that_grow_the_pool() -> None:
    rng = random.Random(1)
    counts = PenaltyCounts(VOCAB, CPU)
    batch = [running(params, 30, rng) for params in PENALISED * 3]
    for _ in range(60):
        counts.tensors(batch)
        for seq in batch:
            seq.append_token(rng.randrange(VOCAB))
    logits = torch.randn(len(batch), VOCAB) * 4
    expected = penalised_logits(logits, penalty_tensors_ref(batch, VOCAB, CPU))
    assert torch.equal(penalised_logits(logits, counts.tensors(batch)), expected)
    assert counts.ids.shape[1] >= VOCAB  # grown past its first width


def test_rows_without_penalties_take_no_slot() -> None:
    counts = PenaltyCounts(VOCAB, CPU)
    batch = [running(SamplingParams(seed=i), 5, random.Random(i)) for i in range(8)]
    meta = SamplingMetadata.from_sequences(batch, VOCAB, CPU, penalty_counts=counts)
    assert meta.penalties is None
    assert counts.rows == {} and counts.ids.shape[0] == 0


def test_the_sampler_edits_a_transposed_logits_tensor_like_a_contiguous_one() -> None:
    rng = random.Random(2)
    batch = [running(params, 8, rng) for params in PENALISED]
    for seq in batch:
        seq.append_token(3)
    params = SamplingParams(temperature=0.0, logit_bias={4: 2.0}, min_tokens=5)
    batch.append(Sequence("b", [1, 2], params, eos_token_ids=frozenset({7})))
    meta = SamplingMetadata.from_sequences(
        batch, VOCAB, CPU, penalty_counts=PenaltyCounts(VOCAB, CPU)
    )
    logits = torch.randn(VOCAB, len(batch)).t()  # [B, V], not contiguous
    assert Sampler()(logits, meta).token_ids == Sampler()(logits.contiguous(), meta).token_ids
