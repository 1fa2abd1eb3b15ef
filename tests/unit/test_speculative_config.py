"""The speculative config (axon/speculative_config.py): vLLM's object, from every entry point,
refused with the key named when it is wrong."""

from __future__ import annotations

import pytest

from axon.config import EngineConfig
from axon.settings import SETTINGS
from axon.speculative_config import SpeculativeConfig, parse

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}  # fmt: skip


def test_ngram_parses_from_a_dict_json_and_pairs():
    expected = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert parse(NGRAM) == expected
    setting = SETTINGS["speculative_config"]
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    text += '"prompt_lookup_max": 5}'
    assert parse(setting.convert(text)) == expected
    pairs = "method=ngram,num_speculative_tokens=4,prompt_lookup_min=2,prompt_lookup_max=5"
    assert parse(setting.convert(pairs)) == expected
    assert parse(None) is None


def test_engine_config_holds_the_parsed_object_and_survives_replace():
    from dataclasses import replace

    config = EngineConfig(model="m.gguf", speculative_config=NGRAM)
    assert config.speculative_config == parse(NGRAM)
    again = replace(config, max_num_seqs=3)
    assert again.speculative_config == config.speculative_config
    assert EngineConfig(model="m.gguf").speculative_config is None


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"method": "ngram", "num_speculative_tokens": 4, "lookup": 3}, "lookup"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
          "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
          "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
          "activation_precision": "int4"}, "activation_precision"),
    ],
)  # fmt: skip
def test_a_bad_key_or_value_is_an_error_naming_the_key(value, named):
    with pytest.raises(ValueError, match=named):
        parse(value)
    with pytest.raises(ValueError, match=named):
        EngineConfig(model="m.gguf", speculative_config=value)


def test_draft_model_keeps_its_own_quant_and_dtype():
    spec = parse({"method": "draft_model", "num_speculative_tokens": 3, "model": "d.gguf",
                  "quant": "Q4_0", "dtype": "float32"})  # fmt: skip
    assert (spec.model, spec.quant, spec.dtype) == ("d.gguf", "Q4_0", "float32")
    assert "draft d.gguf" in spec.describe()
