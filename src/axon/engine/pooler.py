"""The engine side of embedding steps: marks a step's batch for pooling and turns what the
runner pools into each finished prompt's vector. Mean pooling adds a prompt's chunks up here,
across steps, since a chunked prompt's rows are spread over several forwards."""

from __future__ import annotations

import torch

from axon.batch import SchedulerOutput
from axon.loader.pooling import PoolingConfig


class Pooler:
    def __init__(self, config: PoolingConfig):
        self.config = config
        self._sums: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] sum of its rows so far

    def prepare(self, batch, out: SchedulerOutput) -> None:
        """Marks `batch` (the runner's StepBatch for `out`) as a pooling step."""
        batch.pooling = self.config.mode
        if self.config.mode == "mean":
            counts = torch.tensor([num_new for _, num_new in out.scheduled])
            segments = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [T]
            batch.pool_segments = segments.to(batch.input_ids.device)

    def collect(self, out: SchedulerOutput, pooled: torch.Tensor) -> dict[int, list[float]]:
        """seq_id -> vector of each prompt that ends this step (call before the scheduler's
        update: it reads the sequences' computed tokens). `pooled`: the runner's output."""
        vectors = {}
        if self.config.mode == "last":
            ending = [seq for seq, n in out.scheduled if seq.num_computed_tokens + n == len(seq)]
            for seq, row in zip(ending, pooled):
                vectors[seq.seq_id] = row
        else:
            for (seq, num_new), row in zip(out.scheduled, pooled):
                start = seq.num_computed_tokens
                # A chunk from token 0 starts afresh (a first chunk, or recompute after a
                # preemption, which never reuses the prefix cache for mean pooling).
                previous = self._sums.pop(seq.seq_id, None)
                total = row if start == 0 else previous + row
                if start + num_new < seq.num_prompt_tokens:
                    self._sums[seq.seq_id] = total
                else:
                    vectors[seq.seq_id] = total / seq.num_prompt_tokens
        return {seq_id: self._finish(vector) for seq_id, vector in vectors.items()}

    def _finish(self, vector: torch.Tensor) -> list[float]:
        if self.config.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.cpu().tolist()

    def forget(self, seq_ids) -> None:
        """Drops the partial sums of aborted sequences."""
        for seq_id in seq_ids:
            self._sums.pop(seq_id, None)
