"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from axon.layers.linear import SmallBatchLinear, materialize
from axon.layers.quantized import QuantizedEmbedding, QuantizedMatmul, QuantizedTensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quantized: QuantizedEmbedding | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if isinstance(loaded, QuantizedTensor):
            self._load_quantized(param, loaded)
            return
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding shape mismatch: expected ({self.vocab_size}, {param.shape[1]}), "
                f"checkpoint {tuple(loaded.shape)}"
            )
        rows = min(self.shard_size, self.vocab_size - self.vocab_start)
        param.data.zero_()
        param.data[:rows].copy_(materialize(loaded.narrow(0, self.vocab_start, rows)))

    def _load_quantized(self, param: nn.Parameter, qt: QuantizedTensor) -> None:
        """Keep a GGUF embedding quantized (a rank: its vocab rows, padded like the dense
        shard); the dense weight is dropped."""
        if tuple(qt.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"embedding shape mismatch: expected ({self.vocab_size}, {param.shape[1]}), "
                f"checkpoint {tuple(qt.shape)} ({qt.type_name})"
            )
        if self.tp_size > 1:
            rows = min(self.shard_size, self.vocab_size - self.vocab_start)
            qt = qt.narrow(0, self.vocab_start, rows).owned().padded(self.shard_size)
        self.quantized = QuantizedEmbedding(qt)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if self.quantized is not None:
                return self.quantized.lookup(input_ids, self.weight.dtype)  # [T, hidden]
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        local = local.masked_fill(outside, 0)
        if self.quantized is not None:
            out = self.quantized.lookup(local, self.weight.dtype)  # [T, hidden]
        else:
            out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; shares the embedding's weight when tied."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.head: QuantizedMatmul | None = None  # an untied GGUF `output.weight`
        self._linear = SmallBatchLinear()
        self._tied: tuple[VocabParallelEmbedding, ...] = ()  # a tuple: not a submodule

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self._tied = (embedding,)

    def _load_quantized(self, param: nn.Parameter, qt: QuantizedTensor) -> None:
        super()._load_quantized(param, qt)  # this rank's rows
        self.head, self.quantized = self.quantized.build_matmul(), None  # it only multiplies

    def _quantized_matmul(self) -> QuantizedMatmul | None:
        if self._tied and self._tied[0].quantized is not None:
            return self._tied[0].quantized.build_matmul()
        return self.head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        matmul = self._quantized_matmul()
        if matmul is not None:
            logits = matmul(hidden)  # [B, V / tp]
        else:
            logits = self._linear(hidden, self.weight)  # [B, V / tp]
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]
