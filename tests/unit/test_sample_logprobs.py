"""A sample's logprobs in the HTTP process (axon.outputs.SampleLogprobs): read as vLLM's
list[dict[int, Logprob]], held as nothing the cyclic GC walks (issue 32 point 3: full GC passes
over per-token Logprob objects stalled the event loop while a big answer was produced)."""

from __future__ import annotations

import gc
import pickle

from axon.engine.messages import WireLogprobs
from axon.engine.output_processor import SampleState
from axon.outputs import Logprob, SampleLogprobs, TokenUpdate
from axon.sampling_params import SamplingParams

TOKENS, TOP = 200, 20


class _Pieces:
    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def _wire(step: int) -> WireLogprobs:
    top = [(1000 + step * TOP + i, -0.1 * (i + 1)) for i in range(TOP)]
    return WireLogprobs(step, -2.5, TOP + 1, top)  # the sampled token is not in its top


def _filled_sample() -> SampleState:
    sample = SampleState(0, SamplingParams(max_tokens=TOKENS, logprobs=TOP), [1, 2], None)
    for step in range(TOKENS):
        sample.add(TokenUpdate("r", 0, step, _wire(step)))
    return sample


def test_a_samples_logprobs_leave_nothing_for_the_gc_to_walk():
    gc.collect()
    before = len(gc.get_objects())
    sample = _filled_sample()
    gc.collect()
    # 21 Logprob objects and a dict per token were 4,400 tracked objects here
    assert len(gc.get_objects()) - before < TOKENS // 2
    assert len(sample.logprobs) == TOKENS


def test_a_position_reads_as_vllms_dict_of_logprobs():
    logprobs = SampleLogprobs(_Pieces())
    for step in range(3):
        logprobs.add(_wire(step))
    entry = logprobs[1]
    assert list(entry)[:2] == [1020, 1021] and len(entry) == TOP + 1
    assert entry[1020] == Logprob(-0.1, rank=1, decoded_token="<1020>")
    assert entry[1] == Logprob(-2.5, rank=TOP + 1, decoded_token="<1>")
    assert logprobs[-1] == logprobs[2] and logprobs[1:] == [logprobs[1], logprobs[2]]
    (first, *rest) = logprobs
    assert first == logprobs[0] and len(rest) == 2
    assert logprobs == list(logprobs) and pickle.loads(pickle.dumps(logprobs)) == logprobs


def test_the_sampled_token_in_its_top_keeps_its_own_rank():
    logprobs = SampleLogprobs()
    logprobs.add(WireLogprobs(7, -0.2, 1, [(7, -0.2), (3, -1.0)]))
    assert logprobs[0] == {7: Logprob(-0.2, rank=1), 3: Logprob(-1.0, rank=2)}
