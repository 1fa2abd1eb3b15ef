"""The decode-only batch (runner/decode_batch.py) against the values written out by hand: which
steps take it, and the input ids, positions, cache slots and key slots it builds."""

from __future__ import annotations

import torch

from axon.batch import SchedulerOutput
from axon.runner.decode_batch import HostBuffers, decode_inputs, is_decode_only
from axon.sampling_params import SamplingParams
from axon.sequence import ImageInputs, Sequence

CPU = torch.device("cpu")
BLOCK = 4


def decoding(tokens: list[int], block_table: list[int], state_slot: int | None = None):
    """A sequence whose tokens but the last are computed: its next step is a decode."""
    seq = Sequence("req", tokens, SamplingParams(temperature=0.0))
    seq.num_computed_tokens = len(tokens) - 1
    seq.block_table = block_table
    seq.state_slot = state_slot
    return seq


def reference_key_slots(seqs: list[Sequence], width: int) -> list[list[int]]:
    """Slot of key position p: block_table[p // BLOCK] * BLOCK + p % BLOCK, block 0 past the
    table's end (the general path's padding)."""
    rows = []
    for seq in seqs:
        table = seq.block_table
        rows.append(
            [(table[p // BLOCK] if p // BLOCK < len(table) else 0) * BLOCK + p % BLOCK
             for p in range(width)]
        )  # fmt: skip
    return rows


def test_decode_inputs_match_the_hand_written_values() -> None:
    short = decoding([5, 6, 7], [9])  # 3 tokens: position 2 in block 9
    long = decoding(list(range(100, 110)), [3, 7, 1])  # 10 tokens: position 9 in block 1
    out = SchedulerOutput(scheduled=[(short, 1), (long, 1)])
    assert is_decode_only(out)
    inputs = decode_inputs(out, BLOCK, CPU)
    assert inputs.input_ids.tolist() == [7, 109]
    assert inputs.positions.tolist() == [2, 9]
    assert inputs.attn.slot_mapping.tolist() == [9 * BLOCK + 2, 1 * BLOCK + 1]
    assert inputs.attn.decode_context_lens.tolist() == [3, 10]
    key_slots = inputs.attn.decode_key_slots
    assert key_slots.tolist() == reference_key_slots([short, long], 10)
    assert key_slots.is_contiguous() and key_slots.dtype == torch.long  # the C layers' layout
    assert inputs.rows.tolist() == [0, 1]
    assert inputs.attn.decode_state_slots is None


def test_state_slots_and_mrope_offsets_are_carried() -> None:
    seq = decoding([1, 2, 3, 4, 5], [2, 6], state_slot=3)
    seq.images = ImageInputs(None, [], [], [], None, mrope_delta=-7)
    seq.num_prompt_tokens = 3  # past the prompt: plain positions, index + delta
    inputs = decode_inputs(SchedulerOutput(scheduled=[(seq, 1)]), BLOCK, CPU)
    assert inputs.positions.tolist() == [4 - 7]
    assert inputs.attn.decode_state_slots.tolist() == [3]
    assert inputs.attn.decode_key_slots.tolist() == reference_key_slots([seq], 5)


def test_only_steps_where_every_sequence_samples_its_one_last_token_qualify() -> None:
    decode = decoding([1, 2, 3], [0])
    assert is_decode_only(SchedulerOutput(scheduled=[(decode, 1)]))
    chunk = decoding([1, 2, 3, 4, 5], [1, 2])
    chunk.num_computed_tokens = 2  # one token of a prompt that goes on: nothing sampled
    assert not is_decode_only(SchedulerOutput(scheduled=[(decode, 1), (chunk, 1)]))
    first = decoding([1], [3])  # a one-token prompt: a prefill from token 0
    assert not is_decode_only(SchedulerOutput(scheduled=[(first, 1)]))
    saving = SchedulerOutput(scheduled=[(decode, 1)], state_saves=[(0, 4, 0)])
    assert not is_decode_only(saving)  # a snapshot due: the general path copies it
    image = decoding([1, 2, 3], [4])
    image.images = ImageInputs(None, [], [], [], None, mrope_delta=0)
    assert not is_decode_only(SchedulerOutput(scheduled=[(image, 1)]))  # an image prompt token


def test_host_columns_give_the_same_tensors_and_reuse_them_step_to_step() -> None:
    host = HostBuffers()
    seqs = [
        decoding([1, 2, 3], [5], state_slot=1),
        decoding(list(range(20)), [4, 0, 2, 7, 6, 3], state_slot=0),
    ]
    out = SchedulerOutput(scheduled=[(seq, 1) for seq in seqs])
    fresh, reused = decode_inputs(out, BLOCK, CPU), decode_inputs(out, BLOCK, CPU, host)
    for a, b in [
        (fresh.input_ids, reused.input_ids),
        (fresh.positions, reused.positions),
        (fresh.attn.slot_mapping, reused.attn.slot_mapping),
        (fresh.attn.decode_context_lens, reused.attn.decode_context_lens),
        (fresh.attn.decode_state_slots, reused.attn.decode_state_slots),
        (fresh.attn.decode_key_slots, reused.attn.decode_key_slots),
    ]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    for seq in seqs:  # the next step: same tensors, the new values
        seq.append_token(99)
        seq.num_computed_tokens += 1
    again = decode_inputs(out, BLOCK, CPU, host)
    assert again.input_ids is reused.input_ids and again.input_ids.tolist() == [99, 99]
    assert again.positions.tolist() == [3, 20]
    many = [decoding([1, 2], [i]) for i in range(40)]  # more rows than the array holds
    wide = decode_inputs(SchedulerOutput(scheduled=[(s, 1) for s in many]), BLOCK, CPU, host)
    assert wide.attn.slot_mapping.tolist() == [i * BLOCK + 1 for i in range(40)]


def test_a_lone_sequences_key_slots_are_extended_step_by_step_and_redone_for_a_new_table():
    host = HostBuffers()
    seq = decoding([1, 2], [7])
    out = SchedulerOutput(scheduled=[(seq, 1)])
    for _ in range(40):  # through ten blocks, the kept array growing twice
        inputs = decode_inputs(out, BLOCK, CPU, host)
        width = seq.num_computed_tokens + 1
        assert inputs.attn.decode_key_slots.tolist() == reference_key_slots([seq], width)
        seq.append_token(5)
        seq.num_computed_tokens += 1
        if seq.num_computed_tokens % BLOCK == 0:
            seq.block_table.append(100 + seq.num_computed_tokens)
    seq.block_table = list(reversed(seq.block_table))  # a new table (readmitted elsewhere)
    inputs = decode_inputs(out, BLOCK, CPU, host)
    width = seq.num_computed_tokens + 1
    assert inputs.attn.decode_key_slots.tolist() == reference_key_slots([seq], width)


def test_a_decode_with_drafts_is_one_decode_row_per_token() -> None:
    """Speculative decoding: the decode token and its drafts are rows of their own, each
    attending up to its position; the kept key slots are not used (a rejected draft's block
    goes back to the pool)."""
    plain = decoding([5, 6, 7], [9])
    drafted = decoding([100, 101, 102, 103], [3, 7])  # decode at position 3, drafts at 4, 5
    drafted.spec_token_ids = [104, 105]
    out = SchedulerOutput(scheduled=[(plain, 1), (drafted, 3)])
    assert is_decode_only(out)
    inputs = decode_inputs(out, BLOCK, CPU, HostBuffers())
    assert inputs.input_ids.tolist() == [7, 103, 104, 105]
    assert inputs.positions.tolist() == [2, 3, 4, 5]
    assert inputs.attn.slot_mapping.tolist() == [9 * 4 + 2, 3 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]
    assert inputs.attn.decode_context_lens.tolist() == [3, 4, 5, 6]
    rows = [plain, drafted, drafted, drafted]
    assert inputs.attn.decode_key_slots.tolist() == reference_key_slots(rows, 6)
    assert inputs.seqs == rows and inputs.offsets == [0, 0, 1, 2]
    assert inputs.rows.tolist() == [0, 1, 2, 3]


def test_drafts_of_a_sequence_with_recurrent_state_take_the_general_path() -> None:
    seq = decoding([1, 2, 3], [0], state_slot=2)  # a GDN layer chains its verify rows' states
    seq.spec_token_ids = [4]
    assert not is_decode_only(SchedulerOutput(scheduled=[(seq, 2)]))
    seq.state_slot = None
    assert is_decode_only(SchedulerOutput(scheduled=[(seq, 2)]))
    assert not is_decode_only(SchedulerOutput(scheduled=[(seq, 3)]))  # not 1 + its drafts
