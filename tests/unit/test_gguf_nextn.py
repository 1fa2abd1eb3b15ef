"""A GGUF file's `nextn` (multi-token-prediction) block under Qwen3.5's `mtp.*` names: skipped
by default, yielded with `with_mtp`, its norms' `+ 1` undone, a MoE block's experts one by one;
the config announces it as `mtp_num_hidden_layers`."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from axon.loader.gguf import iterate_gguf, mtp_name
from axon.loader.gguf_reader import BulkGGUFReader


def _write(path, arch: str, tensors: dict[str, np.ndarray]) -> BulkGGUFReader:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return BulkGGUFReader(str(path))


def test_nextn_tensors_load_as_the_mtp_block(tmp_path):
    reader = _write(
        tmp_path / "mtp.gguf",
        "qwen35",
        {
            "blk.0.attn_norm.weight": np.full(4, 1.5, dtype=np.float32),
            "blk.1.nextn.eh_proj.weight": np.ones((4, 8), dtype=np.float32),
            "blk.1.nextn.enorm.weight": np.full(4, 1.25, dtype=np.float32),
            "blk.1.nextn.hnorm.weight": np.full(4, 0.75, dtype=np.float32),
            "blk.1.nextn.shared_head_norm.weight": np.full(4, 2.0, dtype=np.float32),
            "blk.1.attn_q.weight": np.ones((8, 4), dtype=np.float32),
            "blk.1.attn_q_norm.weight": np.full(2, 1.5, dtype=np.float32),
        },
    )
    assert [name for name, _ in iterate_gguf(reader)] == ["model.layers.0.input_layernorm.weight"]
    loaded = dict(iterate_gguf(reader, with_mtp=True))
    assert sorted(loaded) == [
        "model.layers.0.input_layernorm.weight",
        "mtp.fc.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ]
    # Stored as w + 1 (zero-centred norms), held as w.
    assert torch.equal(loaded["mtp.pre_fc_norm_embedding.weight"], torch.full((4,), 0.25))
    assert torch.equal(loaded["mtp.pre_fc_norm_hidden.weight"], torch.full((4,), -0.25))
    assert torch.equal(loaded["mtp.norm.weight"], torch.full((4,), 1.0))
    assert torch.equal(loaded["mtp.layers.0.self_attn.q_norm.weight"], torch.full((2,), 0.5))


def test_a_moe_nextn_layer_names_its_experts_under_mtp():
    assert mtp_name("blk.40.ffn_gate_exps.weight", "qwen35moe", 40) == (
        "mtp.layers.0.mlp.experts.gate_proj.weight"
    )
    assert mtp_name("blk.40.ffn_gate_inp_shexp.weight", "qwen35moe", 40) == (
        "mtp.layers.0.mlp.shared_expert_gate.weight"
    )
    assert mtp_name("blk.40.nextn.eh_proj.weight", "qwen35moe", 40) == "mtp.fc.weight"
