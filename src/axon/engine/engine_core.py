"""The owner loop: one object owns the runner, the KV blocks and the scheduler.

Commands (add, abort, step, queries) are plain method calls; engine_proc.py wraps this object in
its own process, so nothing here may assume a frontend.
"""

from __future__ import annotations

import logging

import torch

from axon.cache.block_manager import BlockManager
from axon.cache.state_slots import StateSlotManager
from axon.config import EngineConfig
from axon.engine.drafting import make_drafter
from axon.engine.pooler import Pooler
from axon.engine.prefix_tiers import PrefixTiers
from axon.engine.scheduler import Scheduler
from axon.engine.speculation import Speculator, empty_stats
from axon.engine.step_sampling import StepSampling
from axon.loader.light_config import eos_token_ids
from axon.loader.pooling import load_pooling_config, resolve_task
from axon.outputs import TokenUpdate
from axon.runner.model_runner import ModelRunner
from axon.runner.prompt_logprobs import PromptRows, by_sequence
from axon.sampling.penalties import PenaltyCounts
from axon.sampling.thinking import ThinkingBudget
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence

logger = logging.getLogger(__name__)


class EngineCore(StepSampling):
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config)
        plan = self.runner.plan
        self.block_manager = BlockManager(
            plan.num_blocks, plan.block_size, config.enable_prefix_caching
        )
        self.state_slots = None
        snapshot_interval = 0
        if plan.num_state_slots:
            self.state_slots = StateSlotManager(plan.num_state_slots, plan.num_state_snapshots)
            if plan.num_state_snapshots:
                snapshot_interval = plan.block_size * config.state_snapshot_stride
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            plan.max_model_len,
            self.state_slots,
            snapshot_interval,
        )
        # --prefix-cache-host-size / --prefix-cache-dir: the prefix cache's tiers past the KV
        # cache (None without them)
        self.prefix_tiers = PrefixTiers.open(
            config, self.runner, self.block_manager, self.state_slots
        )
        self.max_model_len = plan.max_model_len
        self.eos_token_ids = eos_token_ids(config.model, self.runner.text_config)
        self.task = resolve_task(config.task, config.model)
        self.pooler = None  # the embed task's: each prompt's pooled hidden state is its output
        if self.task == "embed":
            self.pooler = Pooler(load_pooling_config(config.model, self.runner.hf_config))
        # Prompt tokens the engine computed, each once per sequence: not those served from the
        # prefix cache, nor those recomputed after a preemption (already counted; recomputed
        # output tokens are in neither counter). Generation tokens: tokens sampled. Per-request
        # prompt lengths, cached or not, are the server's `axon:prompt_tokens`, as in vLLM.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._captured_logits: dict[int, torch.Tensor] | None = None
        self._structured = None  # StructuredOutputs, made by the first request that needs it
        # Penalised sequences' token counts, kept across steps (not rebuilt from token lists).
        self.penalty_counts = PenaltyCounts(self.runner.vocab_size, self.runner.device)
        # seq_id -> {prompt position: its logprobs entry}, gathered chunk by chunk until the
        # sequence's first token, which carries them out
        self._prompt_logprobs: dict[int, dict[int, tuple]] = {}
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests' sequences
        # The requests of the step in progress: what a failed step fails (and no more).
        self.step_request_ids: set[str] = set()
        self.speculator = self._make_speculator()

    def _make_speculator(self) -> Speculator | None:
        """Speculative decoding's drafter and verifier, when the config asks for it. Raises
        ValueError when the model cannot use the method."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.task == "embed":
            raise ValueError("speculative_config applies to generation, not an embedding model")
        plan = self.runner.plan
        if self.state_slots is not None:  # drafts' states after the snapshot pool
            self.scheduler.use_draft_states(plan.num_state_snapshots, plan.num_draft_state_rows)
        speculator = Speculator(spec, make_drafter(self.config, self.runner), self.max_model_len)
        logger.info(
            "%s; a sequence drafts while its acceptance pays for the verify rows, at most %d "
            "running",
            spec.describe(),
            speculator.max_seqs,
        )
        return speculator

    # ---- commands ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: dict | None = None,
    ) -> list[Sequence]:
        """Queue a request as `params.n` sequences. `images`: {"pixel_values": [N, D],
        "grid_thw": [(t, h, w), ...]} for a prompt whose image placeholders are already expanded.
        Raises ValueError for an impossible prompt (or images that do not match it)."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        image_inputs = None
        if images is not None:
            image_inputs = self.runner.image_inputs(prompt_token_ids, **images)
        seqs = [
            Sequence(
                request_id,
                prompt_token_ids,
                params,
                index=i,
                eos_token_ids=self.eos_token_ids,
                images=image_inputs,
            )
            for i in range(params.n)
        ]
        if self.pooler is not None:
            if len(seqs) > 1 or images is not None:
                raise ValueError("an embedding request has one sample and no images")
            seqs[0].pooling = self.pooler.config.mode
        for child in seqs[1:]:
            child.fork_parent = seqs[0]
        if params.structured_output is not None:
            for seq in seqs:
                seq.grammar = self.structured.matcher(params.structured_output)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        for seq in seqs:
            seq.thinking_budget = ThinkingBudget.of(params)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return seqs

    def abort(self, request_ids: list[str] | set[str]) -> list[Sequence]:
        """Finish these requests now, freeing their blocks; unknown ids are ignored."""
        aborted = self.scheduler.abort(set(request_ids))
        if self.speculator is not None:
            self.speculator.release(aborted)
        for seq in aborted:
            self._prompt_logprobs.pop(seq.seq_id, None)
        if self.pooler is not None:
            self.pooler.forget(seq.seq_id for seq in aborted)
        for request_id in request_ids:
            self.requests.pop(request_id, None)
        return aborted

    def stop_sample(self, request_id: str, index: int) -> None:
        """Finish one sample early (the frontend matched a stop string)."""
        seqs = self.requests.get(request_id)
        if seqs is None or index >= len(seqs):
            return
        self.scheduler.finish_stopped(seqs[index])
        self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, if any (the engine is done with the device), and
        writes the disk tier's queued blocks."""
        if self.prefix_tiers is not None:
            self.prefix_tiers.close()  # first: the other ranks write their queues too
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenUpdate]:
        """Schedule, run and sample one step; returns one update per scheduled sequence."""
        self.step_request_ids = set()
        tier = self.prefix_tiers
        if tier is not None:
            tier.prefetch(self.scheduler.waiting, self.scheduler.num_running)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        filled = tier.mark(out) if tier is not None else None
        self.step_request_ids = {seq.request_id for seq, _ in out.scheduled}
        if out.is_empty:
            if self.scheduler.num_waiting and not self.scheduler.num_running:
                # With nothing running every block is free or evictable: a waiting sequence
                # that still cannot start never will. Fail loudly instead of spinning.
                self.step_request_ids = {seq.request_id for seq in self.scheduler.waiting}
                raise RuntimeError(f"scheduler stalled with {self.scheduler.num_waiting} waiting")
            return []
        batch = self.runner.prepare(out)
        if self.pooler is not None:
            return self._embed_step(out, batch, filled)
        logits = self.runner.forward_logits(batch)
        if self.speculator is not None and batch.samples_every_row:  # decode-only: a row cost
            self.speculator.time_step(len(batch.sampling_seqs), self.runner.forward_seconds)
        self._keep_prompt_logprobs(batch.prompt)
        sampled, logprobs = self._sample(batch.sampling_seqs, logits, batch.sample_offsets)
        self.num_prompt_tokens += sum(seq.num_new_prompt_tokens(n) for seq, n in out.scheduled)
        if batch.sample_offsets is not None:
            updates = self._finish_drafted_step(out, sampled, logprobs)
        else:
            updates = self._finish_step(out, sampled, logprobs)
        if tier is not None:
            tier.save(filled, out)
        return updates

    def _after_step(self, out, finished: list[Sequence]) -> None:
        for seq in finished:
            self._forget_if_done(seq.request_id)
        if self.speculator is not None:
            self.speculator.release([*finished, *out.preempted])

    def _keep_prompt_logprobs(self, prompt: PromptRows | None) -> None:
        """Keeps the prompt logprobs a step computed, by sequence and position (a position a
        recompute after a preemption computes again is overwritten)."""
        if prompt is None:
            return
        for seq_id, (first, entries) in by_sequence(prompt).items():
            kept = self._prompt_logprobs.setdefault(seq_id, {})
            kept.update(zip(range(first, first + len(entries)), entries))

    def _take_prompt_logprobs(self, seq: Sequence, sampled: dict) -> list | None:
        """The prompt logprobs of `seq` (None first, then one entry per prompt position) once
        its first token is sampled, when it asked for them; else None."""
        if seq.sampling_params.prompt_logprobs is None or seq.index != 0:
            return None
        if seq.seq_id not in sampled or seq.num_output_tokens != 1:
            return None
        kept = self._prompt_logprobs.pop(seq.seq_id, {})
        return [None] + [kept.get(position) for position in range(1, seq.num_prompt_tokens)]

    def _embed_step(self, out, batch, filled) -> list[TokenUpdate]:
        """A step of the embed task: prefill only, and each prompt that ends this step finishes
        (its blocks freed) with its pooled vector as the update's `embedding`."""
        self.pooler.prepare(batch, out)
        vectors = self.pooler.collect(out, self.runner.forward_logits(batch))
        self.num_prompt_tokens += sum(seq.num_new_prompt_tokens(n) for seq, n in out.scheduled)
        self.scheduler.update(out, {})
        if self.prefix_tiers is not None:
            self.prefix_tiers.save(filled, out)
        updates = []
        for seq, _ in out.scheduled:
            updates.append(self._update_of(seq, {}, {}, vectors.get(seq.seq_id)))
            if seq.is_finished:
                self._forget_if_done(seq.request_id)
        return updates

    # ---- queries and debug hooks ------------------------------------------------------------

    def forward_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Last-position logits [V] for each prompt, computed through the real scheduler
        (batched, paged, chunked) with one greedy token each; for tests and debugging."""
        self._captured_logits = {}
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            seqs = [self.add_request(f"logits-{i}", p, params)[0] for i, p in enumerate(prompts)]
            while any(not s.is_finished for s in seqs):
                self.step()
            return [self._captured_logits[s.seq_id].cpu() for s in seqs]
        finally:
            self._captured_logits = None

    def encode_image(self, pixel_values, grid_thw) -> torch.Tensor:
        """The vision tower's output [num_merged_tokens, hidden] for preprocessed images (on
        CPU); for tests. Raises ValueError without a tower or for inputs that disagree."""
        return self.runner.encode_images(torch.as_tensor(pixel_values), grid_thw).cpu()

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()
        if self.state_slots is not None:
            self.state_slots.reset_snapshots()
        if self.prefix_tiers is not None:
            self.prefix_tiers.reset()

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "kv_cache_usage": bm.usage,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "state_snapshot_restores": self.state_slots.num_restores if self.state_slots else 0,
            **(self.prefix_tiers.stats() if self.prefix_tiers is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else empty_stats()),
        }
