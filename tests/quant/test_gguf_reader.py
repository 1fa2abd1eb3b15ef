"""axon's bulk GGUF metadata reader returns what gguf-py's own reader returns; the config's
vocabulary size and class are read without the work the engine does not need."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from axon.loader.gguf import _MODEL_TYPES
from axon.loader.gguf_config import CONFIG_CLASSES, _num_tokens, config_class
from axon.loader.gguf_reader import BulkGGUFReader


def _write(path) -> None:
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_block_count(3)
    writer.add_float32("qwen35.rope.freq_base", 1e7)
    writer.add_string("general.name", "tïny")
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_token_list(["a", "", "ünï", "<|im_end|>", "Ġthe"] * 50)
    writer.add_token_types([1, 3, 1, 4, 6] * 50)
    writer.add_token_scores([0.5, -1.0, 2.0, 0.0, 3.25] * 50)
    writer.add_array("qwen35.attention.recurrent_layers", [True, True, False])
    writer.add_array("qwen35.rope.dimension_sections", [11, 11, 10, 0])
    weight = np.arange(64 * 4, dtype=np.float32).reshape(4, 64) / 7
    writer.add_tensor(
        "blk.0.ssm_out.weight", gguf.quants.quantize(weight, Q.Q8_0), raw_dtype=Q.Q8_0
    )
    writer.add_tensor("blk.0.ssm_a", np.array([-1.0, -2.0], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bulk_reader_reads_what_gguf_py_reads(tmp_path):
    path = tmp_path / "meta.gguf"
    _write(path)

    got, want = BulkGGUFReader(str(path)), gguf.GGUFReader(str(path))

    assert list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        assert got.fields[key].types == field.types, key
        assert got.fields[key].contents() == field.contents(), key
    assert got.fields["tokenizer.ggml.tokens"].contents()[:3] == ["a", "", "ünï"]
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for mine, theirs in zip(got.tensors, want.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)


def test_vocab_size_is_read_without_decoding_the_tokens(tmp_path):
    # A byte-level token that is not UTF-8: decoding the array would raise, counting does not.
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", b"\xff\xfe", "b"] * 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    assert _num_tokens(BulkGGUFReader(str(path))) == 21
    assert _num_tokens(gguf.GGUFReader(str(path))) == 21


def test_config_classes_are_autoconfigs():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert set(CONFIG_CLASSES) == set(_MODEL_TYPES.values())
    for model_type in CONFIG_CLASSES:
        assert config_class(model_type) is CONFIG_MAPPING[model_type], model_type
