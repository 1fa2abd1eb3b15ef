"""The request-size caps (server/admission.py): their defaults, derived from the model, and
what each counts. The routes' 400s against a real server: tests/faults/test_admission.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from axon.sampling_params import SamplingParams
from axon.server.admission import RequestCaps
from axon.server.config import ServerConfig
from axon.server.errors import BadRequest


def _model(task="generate", max_num_seqs=64, max_model_len=4096):
    return SimpleNamespace(
        id="m", task=task, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )


@pytest.mark.parametrize(
    ("model", "sequences", "entries"),
    [
        (_model(), 256, 1 << 21),  # 4 x max_num_seqs
        (_model(max_num_seqs=2), 128, 1 << 21),  # OpenAI's largest n always fits
        (_model(task="embed", max_num_seqs=8), 2048, 1 << 21),  # OpenAI's most inputs
        (_model(max_model_len=262144), 256, 21 * 262144),  # one widest sequence always fits
    ],
)
def test_the_default_caps_come_from_the_model(model, sequences, entries) -> None:
    caps = RequestCaps.of(model, ServerConfig())
    assert (caps.max_sequences, caps.max_output_entries) == (sequences, entries)


def test_configured_caps_replace_the_defaults_and_must_be_positive() -> None:
    config = ServerConfig(max_sequences_per_request=10, max_output_entries_per_request=99)
    caps = RequestCaps.of(_model(), config)
    assert (caps.max_sequences, caps.max_output_entries) == (10, 99)
    with pytest.raises(ValueError, match="max_sequences_per_request"):
        ServerConfig(max_sequences_per_request=0)


def test_sequences_are_prompts_times_n_and_the_refusal_names_the_cap() -> None:
    caps = RequestCaps("m", max_sequences=128, max_output_entries=1 << 21)
    assert caps.check_sequences(64, 2) == 128
    with pytest.raises(BadRequest) as refused:
        caps.check_sequences(20000, 128)
    assert refused.value.code == "max_sequences_per_request"
    assert refused.value.param == "prompt"
    assert "2560000 sequences (20000 prompts × n=128)" in refused.value.message
    assert "at most 128" in refused.value.message
    with pytest.raises(BadRequest) as refused:
        caps.check_sequences(1, 129)
    assert refused.value.param == "n"


def test_output_entries_count_tokens_alternatives_and_prompt_logprobs() -> None:
    caps = RequestCaps("m", max_sequences=256, max_output_entries=1000)
    # 2 prompts x n=2 x 50 tokens x (1 + 4) = 1000: at the cap
    caps.check_params([10, 10], SamplingParams(n=2, max_tokens=50, logprobs=4))
    # prompt logprobs add each prompt token x (1 + prompt_logprobs): 20 x 3 = 60 more
    with pytest.raises(BadRequest) as refused:
        caps.check_params(
            [10, 10], SamplingParams(n=2, max_tokens=50, logprobs=4, prompt_logprobs=2)
        )
    assert refused.value.code == "max_output_entries_per_request"
    assert "1060 output entries" in refused.value.message
    caps.check_params([10], SamplingParams(n=1, max_tokens=1000))  # no logprobs: tokens only
