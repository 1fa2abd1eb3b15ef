"""Turns a scheduled step into one flat token-major batch, runs the model, samples."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field

import torch

from axon.config import EngineConfig
from axon.engine.scheduler import SchedulerOutput
from axon.layers.attention import Attention
from axon.layers.forward_context import AttentionMetadata, PrefillChunk, set_forward_context
from axon.layers.linear_attention import GatedDeltaNet
from axon.loader import iterate_weights, load_hf_config
from axon.loader.weights import load_weights
from axon.models.mrope import image_spans, mrope_positions
from axon.models.registry import get_model_class
from axon.runner.memory import KVCachePlan, kv_bytes_per_token, plan_kv_cache
from axon.sampling import Sampler
from axon.sequence import ImageInputs, Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], or [3, T] (M-RoPE) when a chunk covers image prompt tokens
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [B] rows of the flat batch whose next token is sampled
    sampling_seqs: list[Sequence]
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # (row, slot) before
    state_saves: list[tuple[int, int]] = field(default_factory=list)  # (slot, row) after
    image_rows: torch.Tensor | None = None  # [I] rows whose embedding is an image token's
    image_values: torch.Tensor | None = None  # [I, hidden] the tower's output for those rows


class ModelRunner:
    """Owns the model weights, the KV cache and (hybrid models) the state slots on one device."""

    def __init__(self, config: EngineConfig, hf_config=None):
        self.config = config
        self.device = config.torch_device()
        self.hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
        self.text_config = self.hf_config.get_text_config()
        self.dtype = config.torch_dtype(self.hf_config)
        self.model = self._load_model()
        self.plan = self._allocate_kv_cache()
        self._allocate_state_slots()
        self.sampler = Sampler()
        self.vocab_size = self.text_config.vocab_size

    def _load_model(self) -> torch.nn.Module:
        model_cls = get_model_class(self.hf_config.model_type)
        kwargs = {}
        if getattr(model_cls, "supports_vision", False):
            kwargs["enable_vision"] = self.config.enable_vision
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_cls(self.hf_config, **kwargs)
        finally:
            torch.set_default_dtype(torch.float32)
        load_weights(model, iterate_weights(self.config.model))
        return model.eval()

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _gdn_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]

    def _state_bytes_per_slot(self) -> int:
        """Conv state (model dtype) + recurrent state (fp32) of every GDN layer, per sequence."""
        total = 0
        for layer in self._gdn_layers():
            conv, recurrent = layer.state_shapes()
            total += math.prod(conv) * self.dtype.itemsize + math.prod(recurrent) * 4
        return total

    def _allocate_kv_cache(self) -> KVCachePlan:
        layers = self._attention_layers()
        num_kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        per_token = kv_bytes_per_token(len(layers), num_kv_heads, head_dim, self.dtype)
        model_max_len = self.text_config.max_position_embeddings
        plan = plan_kv_cache(
            self.config, per_token, model_max_len, self.device, self._state_bytes_per_slot()
        )
        shape = (2, len(layers), plan.num_tokens, num_kv_heads, head_dim)
        # Zeroed, so padded (masked) key slots never hold NaN or inf.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for index, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[0, index]  # [slots, Hkv, D]
            layer.v_cache = self.kv_cache[1, index]
        return plan

    def _allocate_state_slots(self) -> None:
        """Per GDN layer: rows [0, slots) are the running sequences' states, the rows after
        them the snapshot pool."""
        rows = self.plan.num_state_slots + self.plan.num_state_snapshots
        for layer in self._gdn_layers():
            conv, recurrent = layer.state_shapes()
            layer.conv_state = torch.zeros(rows, *conv, dtype=self.dtype, device=self.device)
            layer.recurrent_state = torch.zeros(
                rows, *recurrent, dtype=torch.float32, device=self.device
            )

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state row src to row dst for every (src, dst) pair, in every GDN layer."""
        if not pairs:
            return
        src = self._tensor([s for s, _ in pairs])
        dst = self._tensor([d for _, d in pairs])
        for layer in self._gdn_layers():
            layer.conv_state.index_copy_(0, dst, layer.conv_state[src])
            layer.recurrent_state.index_copy_(0, dst, layer.recurrent_state[src])

    # ---- batch preparation ------------------------------------------------------------------

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slots [end - start] of the sequence's tokens at positions [start, end)."""
        block_size = self.plan.block_size
        table = torch.tensor(seq.block_table, dtype=torch.long)
        positions = torch.arange(start, end)
        return table[positions // block_size] * block_size + positions % block_size

    def _slot(self, seq: Sequence, position: int) -> int:
        """The cache slot of the sequence's token at `position` (a decode's one new token: plain
        ints, where the tensor version above costs ~0.1 ms a step in small torch ops)."""
        block, offset = divmod(position, self.plan.block_size)
        return seq.block_table[block] * self.plan.block_size + offset

    def _snapshot_rows(self, out: SchedulerOutput) -> dict[int, list[tuple[int, int]]]:
        """State slot -> [(computed tokens, state row)] of the snapshots due this step."""
        rows: dict[int, list[tuple[int, int]]] = {}
        for slot, computed, index in out.state_saves:
            rows.setdefault(slot, []).append((computed, self.plan.num_state_slots + index))
        return rows

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        input_ids, positions, slots, prefills, decode_rows, decode_seqs = [], [], [], [], [], []
        logits_indices, sampling_seqs, end_saves = [], [], []
        snapshot_rows = self._snapshot_rows(out)
        for seq, num_new in out.scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            # Past an image prompt every M-RoPE row is index + delta: plain 1-D positions.
            delta = seq.images.mrope_delta if seq.images is not None else 0
            positions.extend(range(start + delta, end + delta))
            # A snapshot due at the end of the step is the slot's final state, copied after the
            # forward; one inside a prompt chunk is taken by the GDN layers as they pass it.
            saves = snapshot_rows.get(seq.state_slot, [])
            end_saves.extend((seq.state_slot, r) for computed, r in saves if computed == end)
            if num_new == 1 and start > 0:
                slots.append(self._slot(seq, start))
                decode_rows.append(row)
                decode_seqs.append(seq)
            else:
                slots.append(self._slots(seq, start, end))
                prefills.append(self._prefill_chunk(seq, row, start, end, saves))
            if end == seq.num_tokens:
                logits_indices.append(row + num_new - 1)
                sampling_seqs.append(seq)
        attn = AttentionMetadata(
            slot_mapping=self._slot_mapping(slots),
            prefills=prefills,
            **self._decode_metadata(decode_rows, decode_seqs),
        )
        base = self.plan.num_state_slots
        batch = StepBatch(
            self._tensor(input_ids),
            self._tensor(positions),
            attn,
            self._tensor(logits_indices),
            sampling_seqs,
            [(base + index, slot) for slot, index in out.state_restores],
            end_saves,
        )
        self._add_images(batch, out)
        return batch

    # ---- images -----------------------------------------------------------------------------

    def image_inputs(self, token_ids: list[int], pixel_values, grid_thw) -> ImageInputs:
        """A request's images checked against its (expanded) prompt, with their M-RoPE
        positions and content hashes. Raises ValueError without a tower or on a mismatch."""
        model = self.model
        if getattr(model, "visual", None) is None:
            raise ValueError("this model has no vision tower loaded: images are not supported")
        grids = grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw
        grids = [tuple(int(x) for x in grid) for grid in grids]
        pixel_values = torch.as_tensor(pixel_values, dtype=torch.float32).cpu()
        model.visual.check_inputs(pixel_values, grids)
        ids = (model.spatial_merge_size, model.image_token_id, model.vision_start_token_id)
        positions, delta = mrope_positions(token_ids, grids, *ids)
        hashes, first = [], 0
        for t, h, w in grids:
            patches = pixel_values[first : first + t * h * w]
            first += t * h * w
            digest = hashlib.sha256(repr((t, h, w)).encode())
            digest.update(patches.numpy().tobytes())
            hashes.append(digest.digest())
        spans = image_spans(token_ids, grids, *ids)
        return ImageInputs(pixel_values, grids, spans, hashes, positions, delta)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """The tower's output [num_merged_tokens, hidden] (model dtype, on the device)."""
        if getattr(self.model, "visual", None) is None:
            raise ValueError("this model has no vision tower loaded: images are not supported")
        pixel_values = pixel_values.to(self.device, self.dtype)
        return self.model.encode_images(pixel_values, grid_thw)

    @staticmethod
    def _image_chunks(out: SchedulerOutput) -> list[tuple[Sequence, int, int, int]]:
        """(seq, batch row, start, end) of each scheduled chunk with image-prompt tokens."""
        chunks, row = [], 0
        for seq, num_new in out.scheduled:
            start = seq.num_computed_tokens
            if seq.images is not None and start < seq.num_prompt_tokens:
                chunks.append((seq, row, start, start + num_new))
            row += num_new
        return chunks

    def _add_images(self, batch: StepBatch, out: SchedulerOutput) -> None:
        """When a chunk covers image-prompt tokens: give `batch` M-RoPE positions [3, T] and
        those chunks' image rows (the tower runs once per request). Else leaves it as it is."""
        chunks = self._image_chunks(out)
        if not chunks:
            return  # text and decodes only: 1-D positions, the fast path
        positions = batch.positions.expand(3, -1).clone()  # text rows: three equal rows
        rows, values = [], []
        for seq, row, start, end in chunks:
            images = seq.images
            prompt_end = min(end, seq.num_prompt_tokens)
            prompt_positions = images.positions[:, start:prompt_end]
            positions[:, row : row + prompt_end - start] = prompt_positions.to(self.device)
            offset = 0
            for first, count in images.spans:
                low, high = max(first, start), min(first + count, end)
                if low < high:  # a chunk may cut through an image: take its slice
                    if images.embeds is None:
                        images.embeds = self.encode_images(images.pixel_values, images.grid_thw)
                    rows.append(torch.arange(low, high) + (row - start))
                    values.append(images.embeds[offset + low - first : offset + high - first])
                offset += count
        batch.positions = positions
        if rows:
            batch.image_rows = torch.cat(rows).to(self.device)
            batch.image_values = torch.cat(values)

    def _prefill_chunk(
        self, seq: Sequence, row: int, start: int, end: int, saves: list[tuple[int, int]]
    ) -> PrefillChunk:
        """The chunk of `seq`'s tokens [start, end) at `row` of the batch, with the snapshots
        (computed tokens, state row) due strictly inside it."""
        key_slots = self._slots(seq, 0, end).to(self.device)
        chunk = PrefillChunk(row, end - start, end, key_slots, seq.state_slot, start > 0)
        chunk.state_saves = [(computed - start, r) for computed, r in saves if computed < end]
        return chunk

    def _slot_mapping(self, slots: list) -> torch.Tensor:
        """[T] from each sequence's cache slots: an int (a decode) or a tensor (a chunk)."""
        if all(isinstance(slot, int) for slot in slots):  # decode only
            return self._tensor(slots)
        return torch.cat([torch.tensor([s]) if isinstance(s, int) else s for s in slots]).to(
            self.device
        )

    def _decode_metadata(self, rows: list[int], seqs: list[Sequence]) -> dict:
        if not rows:
            return {
                "decode_token_index": None,
                "decode_key_slots": None,
                "decode_context_lens": None,
                "decode_state_slots": None,
            }
        block_size = self.plan.block_size
        lens = [seq.num_computed_tokens + 1 for seq in seqs]
        width = max(lens)
        num_blocks = -(-width // block_size)
        tables = [seq.block_table[:num_blocks] for seq in seqs]
        tables = torch.tensor([t + [0] * (num_blocks - len(t)) for t in tables])  # [Bd, nb]
        offsets = torch.arange(block_size)
        key_slots = (tables.unsqueeze(-1) * block_size + offsets).view(len(seqs), -1)  # [Bd, nb*bs]
        return {
            "decode_token_index": self._tensor(rows),
            # [Bd, C], padding masked later
            "decode_key_slots": key_slots[:, :width].contiguous().to(self.device),
            "decode_context_lens": self._tensor(lens),
            "decode_state_slots": self._state_slot_tensor(seqs),
        }

    def _state_slot_tensor(self, seqs: list[Sequence]) -> torch.Tensor | None:
        if not seqs or seqs[0].state_slot is None:
            return None
        return self._tensor([seq.state_slot for seq in seqs])

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # ---- execution --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, batch: StepBatch) -> torch.Tensor:
        """Logits [B, V] (float32) for the rows that sample. Hybrid models: restores prefix-hit
        states first and copies the states due at the step's end into their snapshots after."""
        self._copy_states(batch.state_restores)
        with set_forward_context(batch.attn):
            if batch.image_rows is None:
                hidden = self.model(batch.input_ids, batch.positions)  # [T, hidden]
            else:
                embeds = self.model.model.embed(batch.input_ids)  # [T, hidden]
                embeds[batch.image_rows] = batch.image_values.to(embeds.dtype)
                hidden = self.model(batch.input_ids, batch.positions, embeds)
        self._copy_states(batch.state_saves)
        return self.model.compute_logits(hidden[batch.logits_indices])
