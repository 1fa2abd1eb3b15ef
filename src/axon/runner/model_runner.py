"""Turns a scheduled step into one flat token-major batch, runs the model, samples."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch

from axon.batch import SchedulerOutput
from axon.config import EngineConfig
from axon.layers.attention import Attention
from axon.layers.forward_context import AttentionMetadata, PrefillChunk, set_forward_context
from axon.layers.int8_activations import set_activation_precision
from axon.layers.linear_attention import GatedDeltaNet
from axon.loader import load_hf_config, progress
from axon.loader.pooling import resolve_task
from axon.models.registry import get_model_class
from axon.models.weights import load_weights
from axon.runner import adaptive_threads, decode_batch, heap, host_memory, images, tensor_parallel
from axon.runner.memory import KVCachePlan, kv_bytes_per_token, kv_cache_shape, plan_kv_cache
from axon.runner.prompt_logprobs import PromptRows, find_prompt_rows, score_prompt_rows
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
    image_deepstack: torch.Tensor | None = None  # [L, I, hidden] Qwen3-VL: their DeepStack rows
    # Tensor parallelism: (ImageInputs, rows of its tower output) per part of image_values, in
    # order; the other ranks run the tower on the same pixels (see tensor_parallel.py).
    image_takes: list | None = None
    # Embedding steps: "last" or "mean" returns pooled hidden states instead of logits, and
    # for "mean" `pool_segments` [T] gives each row's scheduled-sequence index.
    pooling: str | None = None
    pool_segments: torch.Tensor | None = None
    samples_every_row: bool = False  # logits_indices is arange(T): no gather of rows needed
    prompt: PromptRows | None = None  # rows whose prompt logprobs are asked
    # Speculative decoding: per sampled row, its output position past the sequence's next
    # (0 but for a drafted decode's rows 1..k); None when no sequence drafted.
    sample_offsets: list[int] | None = None


class ModelRunner:
    """Owns the model weights, the KV cache and (hybrid models) the state slots on one device."""

    def __init__(self, config: EngineConfig, hf_config=None, rank: int = 0, on_loaded=None):
        """Rank 0 (the engine) spawns ranks 1..N-1 when `config.tensor_parallel_size` > 1;
        rank > 0 is one of those (`on_loaded` tells rank 0 its shard is loaded)."""
        self.config = config
        self.hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
        self.text_config = self.hf_config.get_text_config()
        self.device = tensor_parallel.rank_device(config, rank)
        self.workers = None  # the other ranks, held by rank 0 (None: a single rank)
        if rank == 0:
            self.workers = tensor_parallel.start_ranks(config, self.hf_config, self.device)
        try:
            self.dtype = config.torch_dtype(self.hf_config)
            self.model = self._load_model(show_progress=rank == 0)
            if self.workers is not None:
                self.workers.expect("loaded")
            elif on_loaded is not None:
                on_loaded()
            self.plan = self._allocate_kv_cache()
            self._allocate_state_slots()
        except BaseException:
            self.close()
            raise
        self.sampler = Sampler()
        # The MTP drafter's: called with each forward's final hidden states [T, hidden].
        self.hidden_sink = None
        self.vocab_size = self.text_config.vocab_size
        self.thread_tuner = adaptive_threads.for_engine(config, self.device)  # None: fixed count
        self.forward_seconds = 0.0  # the latest forward_logits call's wall time
        # Decode inputs reused step to step: one CPU rank only (see HostBuffers).
        single_cpu = self.device.type == "cpu" and self.workers is None
        self._decode_host = decode_batch.HostBuffers() if single_cpu else None
        if self.device.type == "cpu":
            heap.keep_freed_heap()  # a step's activations reused, not faulted in again (heap.py)

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (rank 0; nothing with a single rank)."""
        workers, self.workers = self.workers, None
        tensor_parallel.stop_ranks(workers)

    def _load_model(self, show_progress: bool = True) -> torch.nn.Module:
        model_cls = get_model_class(self.hf_config.model_type)
        kwargs = {}
        if getattr(model_cls, "supports_vision", False):
            kwargs["enable_vision"] = self.config.vision_enabled
        spec = getattr(self.config, "speculative_config", None)
        if spec is not None and spec.method == "mtp" and getattr(model_cls, "supports_mtp", 0):
            kwargs["enable_mtp"] = True  # its mtp.* weights, else skipped
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), tensor_parallel.model_scope(self.config):
                model = model_cls(self.hf_config, **kwargs)
        finally:
            torch.set_default_dtype(torch.float32)
        if resolve_task(self.config.task, self.config.model) == "embed":
            model.optional_weights = ("lm_head.weight",)  # embedders ship without an LM head
        weights = tensor_parallel.checkpoint_weights(self.config)
        if show_progress:  # rank 0 speaks for every rank
            weights = progress.track(weights, self.config.model)
        load_weights(model, weights)
        precision = set_activation_precision(self.config.activation_precision, model)
        self.config = replace(self.config, activation_precision=precision)  # `auto` resolved
        return model.eval()

    def _attention_layers(self) -> list[Attention]:
        mtp = getattr(self.model, "mtp", None)  # its cache is the MTP drafter's
        drafter_owned = set(mtp.modules()) if mtp is not None else ()
        return [m for m in self.model.modules() if isinstance(m, Attention)
                and m not in drafter_owned]  # fmt: skip

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
        kv_dtype = self.config.kv_torch_dtype(self.dtype)
        per_token = kv_bytes_per_token(len(layers), num_kv_heads, head_dim, kv_dtype)
        model_max_len = self.text_config.max_position_embeddings
        plan = plan_kv_cache(
            self.config,
            per_token,
            model_max_len,
            self.device,
            self._state_bytes_per_slot(),
            reserve_bytes=images.vision_reserve(self.model, self.config),
        )
        if self.config.tensor_parallel_size > 1:
            plan = tensor_parallel.agree_on_plan(plan)
        shape = kv_cache_shape(len(layers), plan.num_tokens, num_kv_heads, head_dim, kv_dtype)
        # Zeroed, so padded (masked) key slots never hold NaN or inf; on the CPU zeroed page by
        # page as it fills, not seconds up front (host_memory).
        self.kv_cache = host_memory.zeros(shape, kv_dtype, self.device)
        for index, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[0, index]  # [slots, Hkv, D]
            layer.v_cache = self.kv_cache[1, index]
        return plan

    def _allocate_state_slots(self) -> None:
        """Per GDN layer: rows [0, slots) are the running sequences' states, the rows after
        them the snapshot pool, then the drafts' scratch rows (speculative decoding)."""
        plan = self.plan
        rows = plan.num_state_slots + plan.num_state_snapshots + plan.num_draft_state_rows
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
        ints, where the tensor version above costs a step several small torch ops)."""
        block, offset = divmod(position, self.plan.block_size)
        return seq.block_table[block] * self.plan.block_size + offset

    def _snapshot_rows(self, out: SchedulerOutput) -> dict[int, list[tuple[int, int]]]:
        """State slot -> [(computed tokens, state row)] of the snapshots due this step."""
        rows: dict[int, list[tuple[int, int]]] = {}
        for slot, computed, index in (*out.state_saves, *out.draft_state_saves):
            rows.setdefault(slot, []).append((computed, self.plan.num_state_slots + index))
        return rows

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        """Return the flat batch of `out`'s scheduled tokens (images encoded as they start)."""
        self.scheduled = out.scheduled  # the rows' sequences, for the hidden sink
        if decode_batch.is_decode_only(out):
            return self._prepare_decodes(out)
        input_ids, positions, slots, prefills, decode_rows, decode_seqs = [], [], [], [], [], []
        logits_indices, sampling_seqs, offsets, end_saves = [], [], [], []
        snapshot_rows = self._snapshot_rows(out)
        for seq, num_new in out.scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids.extend(seq.scheduled_token_ids(start, end))
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
            # Every row from the last token on samples: past it come drafts to verify, row i
            # sampled as the output position i past the next.
            first = row + seq.num_tokens - 1 - start
            logits_indices.extend(range(first, row + num_new))
            sampling_seqs.extend([seq] * (row + num_new - first))
            offsets.extend(range(row + num_new - first))
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
            prompt=find_prompt_rows(out, self.device),
            sample_offsets=offsets if any(offsets) else None,
        )
        images.add_images(batch, out, self.encode_images, self.workers is not None)
        return batch

    def _prepare_decodes(self, out: SchedulerOutput) -> StepBatch:
        """A decode-only step's batch: the general path's values, with a few ops (decode_batch)."""
        host = self._decode_host
        inputs = decode_batch.decode_inputs(out, self.plan.block_size, self.device, host)
        base = self.plan.num_state_slots
        return StepBatch(
            inputs.input_ids,
            inputs.positions,
            inputs.attn,
            inputs.rows,
            inputs.seqs,
            [(base + index, slot) for slot, index in out.state_restores],
            samples_every_row=True,
            sample_offsets=inputs.offsets,
        )

    # ---- images -----------------------------------------------------------------------------

    def image_inputs(self, token_ids: list[int], pixel_values, grid_thw) -> ImageInputs:
        """A request's images checked against its (expanded) prompt (runner/images.py)."""
        return images.image_inputs(self.model, token_ids, pixel_values, grid_thw)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw, with_deepstack: bool = False):
        """The tower's output [num_merged_tokens, hidden] (model dtype, on the device); with
        `with_deepstack`, the pair (that, its DeepStack features [L, num_merged_tokens, hidden],
        None for a model without DeepStack)."""
        if getattr(self.model, "visual", None) is None:
            raise ValueError("this model has no vision tower loaded: images are not supported")
        pixel_values = pixel_values.to(self.device, self.dtype)
        encode_with_deepstack = getattr(self.model, "encode_images_with_deepstack", None)
        if with_deepstack and encode_with_deepstack is not None:
            return encode_with_deepstack(pixel_values, grid_thw)
        embeds = self.model.encode_images(pixel_values, grid_thw)
        return (embeds, None) if with_deepstack else embeds

    def _prefill_chunk(
        self, seq: Sequence, row: int, start: int, end: int, saves: list[tuple[int, int]]
    ) -> PrefillChunk:
        """The chunk of `seq`'s tokens [start, end) at `row` of the batch, with the snapshots
        (computed tokens, state row) due strictly inside it."""
        key_slots = self._slots(seq, 0, end).to(self.device)
        chunk = PrefillChunk(row, end - start, end, key_slots, seq.state_slot, start > 0)
        chunk.state_saves = [(computed - start, r) for computed, r in saves if computed < end]
        chunk.verifies = 0 < start == seq.num_tokens - 1  # the last token and its drafts
        return chunk

    def _slot_mapping(self, slots: list) -> torch.Tensor:
        """[T] from each sequence's cache slots: an int (a decode) or a tensor (a chunk)."""
        if all(isinstance(slot, int) for slot in slots):  # decode only
            return self._tensor(slots)
        parts = [torch.tensor([s]) if isinstance(s, int) else s for s in slots]
        return torch.cat(parts).to(self.device)

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
        has_slots = seqs and seqs[0].state_slot is not None
        return self._tensor([seq.state_slot for seq in seqs]) if has_slots else None

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # ---- execution --------------------------------------------------------------------------

    def forward_logits(self, batch: StepBatch) -> torch.Tensor:
        """Logits [B, V] (float32) for the rows that sample; with several ranks, every rank
        runs the step (rank 0 sends it the batch) and rank 0's logits are returned. Its wall
        time goes to `forward_seconds` (speculative decoding measures a row's cost)."""
        started = time.perf_counter()
        if self.workers is not None:
            logits = tensor_parallel.run_step(self, batch)
        elif self.thread_tuner is None:
            logits = self.run_forward(batch)
        else:
            with self.thread_tuner.step(int(batch.input_ids.shape[0])):  # picks, times the count
                logits = self.run_forward(batch)
        self.forward_seconds = time.perf_counter() - started
        return logits

    @torch.inference_mode()
    def run_forward(self, batch: StepBatch) -> torch.Tensor:
        """This rank's forward: logits [B, V] (float32) for the rows that sample. Hybrid models:
        restores prefix-hit states first and copies the states due at the step's end into their
        snapshots after."""
        self._copy_states(batch.state_restores)
        with set_forward_context(batch.attn):
            if batch.image_rows is None:
                hidden = self.model(batch.input_ids, batch.positions)  # [T, hidden]
            else:
                embeds = self.model.model.embed(batch.input_ids)  # [T, hidden]
                embeds[batch.image_rows] = batch.image_values.to(embeds.dtype)
                deepstack = ()
                if batch.image_deepstack is not None:  # added after the first LM layers
                    deepstack = (batch.image_rows, batch.image_deepstack)
                hidden = self.model(batch.input_ids, batch.positions, embeds, *deepstack)
        self._copy_states(batch.state_saves)
        if self.hidden_sink is not None:
            self.hidden_sink(hidden)
        if batch.pooling is not None:
            return self.pool(hidden, batch)
        score_prompt_rows(self.model, hidden, batch.prompt)  # prompt logprobs, when asked
        if not batch.samples_every_row:
            hidden = hidden[batch.logits_indices]  # [B, hidden]
        return self.model.compute_logits(hidden)

    @staticmethod
    def pool(hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Float32 pooling of the final (normed) hidden states [T, hidden]: "last" gives the
        rows at `logits_indices` [B, hidden] (prompts that end this step); "mean" the sum of
        each scheduled sequence's rows [S, hidden], which the engine adds up across chunks."""
        if batch.pooling == "last":
            return hidden[batch.logits_indices].float()
        num_segments = int(batch.pool_segments[-1]) + 1
        sums = hidden.new_zeros(num_segments, hidden.shape[-1], dtype=torch.float32)
        return sums.index_add_(0, batch.pool_segments, hidden.float())  # [S, hidden]
