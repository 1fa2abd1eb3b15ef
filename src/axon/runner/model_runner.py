"""Turns a scheduled step into one flat token-major batch, runs the model, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from axon.config import EngineConfig
from axon.engine.scheduler import SchedulerOutput
from axon.layers.attention import Attention
from axon.layers.forward_context import AttentionMetadata, PrefillChunk, set_forward_context
from axon.loader import iterate_weights, load_hf_config
from axon.loader.weights import load_weights
from axon.models.registry import get_model_class
from axon.runner.memory import KVCachePlan, kv_bytes_per_token, plan_kv_cache
from axon.sampling import Sampler
from axon.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [B] rows of the flat batch whose next token is sampled
    sampling_seqs: list[Sequence]


class ModelRunner:
    """Owns the model weights and the KV cache on one device."""

    def __init__(self, config: EngineConfig, hf_config=None):
        self.config = config
        self.device = config.torch_device()
        self.hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
        self.dtype = config.torch_dtype(self.hf_config)
        self.model = self._load_model()
        self.plan = self._allocate_kv_cache()
        self.sampler = Sampler()
        self.vocab_size = self.hf_config.vocab_size

    def _load_model(self) -> torch.nn.Module:
        model_cls = get_model_class(self.hf_config.model_type)
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_cls(self.hf_config)
        finally:
            torch.set_default_dtype(torch.float32)
        load_weights(model, iterate_weights(self.config.model))
        return model.eval()

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _allocate_kv_cache(self) -> KVCachePlan:
        layers = self._attention_layers()
        num_kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        per_token = kv_bytes_per_token(len(layers), num_kv_heads, head_dim, self.dtype)
        model_max_len = self.hf_config.max_position_embeddings
        plan = plan_kv_cache(self.config, per_token, model_max_len, self.device)
        shape = (2, len(layers), plan.num_tokens, num_kv_heads, head_dim)
        # Zeroed, so padded (masked) key slots never hold NaN or inf.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for index, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[0, index]  # [slots, Hkv, D]
            layer.v_cache = self.kv_cache[1, index]
        return plan

    # ---- batch preparation ------------------------------------------------------------------

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slots [end - start] of the sequence's tokens at positions [start, end)."""
        block_size = self.plan.block_size
        table = torch.tensor(seq.block_table, dtype=torch.long)
        positions = torch.arange(start, end)
        return table[positions // block_size] * block_size + positions % block_size

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        input_ids, positions, slots, prefills, decode_rows, decode_seqs = [], [], [], [], [], []
        logits_indices, sampling_seqs = [], []
        for seq, num_new in out.scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.append(self._slots(seq, start, end))
            if num_new == 1 and start > 0:
                decode_rows.append(row)
                decode_seqs.append(seq)
            else:
                key_slots = self._slots(seq, 0, end).to(self.device)
                prefills.append(PrefillChunk(row, num_new, end, key_slots))
            if end == seq.num_tokens:
                logits_indices.append(row + num_new - 1)
                sampling_seqs.append(seq)
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device),
            prefills=prefills,
            **self._decode_metadata(decode_rows, decode_seqs),
        )
        return StepBatch(
            self._tensor(input_ids),
            self._tensor(positions),
            attn,
            self._tensor(logits_indices),
            sampling_seqs,
        )

    def _decode_metadata(self, rows: list[int], seqs: list[Sequence]) -> dict:
        if not rows:
            return {
                "decode_token_index": None,
                "decode_key_slots": None,
                "decode_context_lens": None,
            }
        block_size = self.plan.block_size
        lens = [seq.num_computed_tokens + 1 for seq in seqs]
        width = max(lens)
        num_blocks = -(-width // block_size)
        tables = [seq.block_table[:num_blocks] for seq in seqs]
        tables = torch.tensor([t + [0] * (num_blocks - len(t)) for t in tables])  # [Bd, nb]
        positions = torch.arange(width)
        key_slots = tables[:, positions // block_size] * block_size + positions % block_size
        return {
            "decode_token_index": self._tensor(rows),
            "decode_key_slots": key_slots.to(self.device),  # [Bd, C], padding masked later
            "decode_context_lens": self._tensor(lens),
        }

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # ---- execution --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, batch: StepBatch) -> torch.Tensor:
        """Logits [B, V] (float32) for the rows that sample."""
        with set_forward_context(batch.attn):
            hidden = self.model(batch.input_ids, batch.positions)  # [T, hidden]
        return self.model.compute_logits(hidden[batch.logits_indices])
