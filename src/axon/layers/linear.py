"""Linear layers that own their tensor-parallel sharding and their weight loading.

Each layer allocates only this rank's slice and attaches `param.weight_loader(param, tensor,
shard_id)`, which narrows a full checkpoint tensor to that slice. The model's `load_weights`
only routes `(name, tensor)` pairs to parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from axon.kernels import ggml_cpu
from axon.layers.quantized import QuantizedParts, QuantizedTensor


class SmallBatchLinear:
    """`F.linear` whose float32 CPU batches of up to MAX_ROWS rows (decode steps) run on the C
    kernel, reading the weight in place; larger ones and other dtypes and devices take
    `F.linear`, the reference twin. Prepared for one weight at a time (it follows the weight's
    memory, so a reload re-prepares)."""

    # The C kernel beats torch's (MKL) float32 GEMM up to 16 rows (1.3-5x on an AMD EPYC) and
    # only sometimes at 64, where MKL's blocking starts to pay.
    MAX_ROWS = 32

    def __init__(self) -> None:
        self._weights: ggml_cpu.GGMLWeights | None = None
        self._address: int | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        small = x.dim() == 2 and x.shape[0] <= self.MAX_ROWS
        if small and x.dtype == torch.float32 and x.device.type == "cpu":
            if self._address != weight.data_ptr():
                self._weights, self._address = ggml_cpu.dense_weights(weight), weight.data_ptr()
            if self._weights is not None:
                y = self._weights.matmul(x)  # [T, N]
                return y if bias is None else y.add_(bias)
        return F.linear(x, weight, bias)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def materialize(loaded) -> torch.Tensor:
    """A checkpoint tensor as a tensor: a lazy slice of the file (a tensor-parallel rank's
    shard, see loader/safetensors.py) is read now; a tensor is returned as it is."""
    read = getattr(loaded, "materialize", None)
    return loaded if read is None else read()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(materialize(loaded))


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.tp_dim = tp_dim
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self._load
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self._load
        else:
            self.register_parameter("bias", None)
        self.quantized: QuantizedParts | None = None
        self._linear = SmallBatchLinear()

    def _load(self, param: nn.Parameter, loaded, *shard_id) -> None:
        if isinstance(loaded, QuantizedTensor):
            self._load_quantized(param, loaded, shard_id[0] if shard_id else None)
        else:
            self.weight_loader(param, loaded, *shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def part_rows(self, shard_id) -> int:
        """This rank's output rows of one checkpoint part (the whole layer when unfused)."""
        return self.output_size

    def quantized_shard(self, qt: QuantizedTensor, shard_id) -> QuantizedTensor:
        """This rank's part of a GGUF weight, as views of its bytes (replicated: all of it)."""
        return qt

    def part_order(self) -> list[str]:
        return ["None"]

    def _load_quantized(self, param: nn.Parameter, qt: QuantizedTensor, shard_id) -> None:
        """Keep a GGUF weight (or one fused part of it) quantized; the dense one is dropped.
        A tensor-parallel rank keeps its own shard, copied out of the mapped file."""
        if self.tp_size > 1 and param is self.weight:
            qt = self.quantized_shard(qt, shard_id).owned()
        expected = (self.part_rows(shard_id), self.input_size)
        if param is not self.weight or tuple(qt.shape) != expected:
            raise ValueError(
                f"shape mismatch: parameter part {expected}, checkpoint {tuple(qt.shape)} "
                f"({qt.type_name})"
            )
        if self.quantized is None:
            self.quantized = QuantizedParts(self.part_order())
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.quantized.add(str(shard_id), qt)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is None:
            return self._linear(x, self.weight, bias)
        out = self.quantized(x)  # [T, out]
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size()), bias, tp_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))

    def quantized_shard(self, qt: QuantizedTensor, shard_id) -> QuantizedTensor:
        return qt.narrow(0, self.tp_rank * self.output_size, self.output_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)

    def part_rows(self, shard_id) -> int:
        return self.output_sizes[shard_id] // self.tp_size

    def quantized_shard(self, qt: QuantizedTensor, shard_id) -> QuantizedTensor:
        size = self.part_rows(shard_id)
        return qt.narrow(0, self.tp_rank * size, size)

    def part_order(self) -> list[str]:
        return [str(i) for i in range(len(self.output_sizes))]


def load_regions(
    param: torch.Tensor, loaded, region_sizes: list[int], rank: int, tp_size: int
) -> None:
    """Load this rank's part of every region of dim 0 (`region_sizes`, in order) of one
    checkpoint tensor into `param`, the parts concatenated: rank r holds the r-th 1/tp_size
    of each region. One rank loads the tensor whole."""
    if tp_size == 1:
        default_weight_loader(param, loaded)
        return
    start, offset = 0, 0
    for size in region_sizes:
        part = divide(size, tp_size)
        shard = loaded.narrow(0, start + rank * part, part)
        default_weight_loader(param.data.narrow(0, offset, part), shard)
        start, offset = start + size, offset + part


class RegionParallelLinear(ColumnParallelLinear):
    """One checkpoint projection whose output is several regions (Gated DeltaNet's fused
    q | k | v), each split across ranks by heads. Its checkpoint tensor is one part, so GGUF
    (one rank) loads it as any unfused linear."""

    def __init__(self, input_size: int, region_sizes: list[int], bias: bool = False):
        self.region_sizes = region_sizes
        super().__init__(input_size, sum(region_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_regions(param, loaded, self.region_sizes, self.tp_rank, self.tp_size)

    def quantized_shard(self, qt: QuantizedTensor, shard_id) -> QuantizedTensor:
        parts, start = [], 0
        for size in self.region_sizes:
            part = divide(size, self.tp_size)
            parts.append(qt.narrow(0, start + self.tp_rank * part, part))
            start += size
        return QuantizedTensor.cat_rows(parts)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks (kv heads replicated if fewer)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        shard = loaded.narrow(0, rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)

    def part_rows(self, shard_id) -> int:
        heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        return heads * self.head_dim

    def quantized_shard(self, qt: QuantizedTensor, shard_id) -> QuantizedTensor:
        size = self.part_rows(shard_id)
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        return qt.narrow(0, rank * size, size)

    def part_order(self) -> list[str]:
        return ["q", "k", "v"]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed, bias added on rank 0 only."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: whole on every rank, added once
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))

    def quantized_shard(self, qt: QuantizedTensor, shard_id) -> QuantizedTensor:
        """Whole quant blocks of every row: the per-rank input width must be a multiple of the
        block size (the server's preflight refuses such a file with a 422 first)."""
        size = self.input_size
        if size % qt.block_size:
            raise ValueError(
                f"row-parallel {qt.type_name} weight {qt.shape}: {size} input columns per rank "
                f"(tensor_parallel_size {self.tp_size}) is not a multiple of its "
                f"{qt.block_size}-column quant block"
            )
        return qt.narrow(1, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self._matmul(x, bias)  # [T, out], this rank's partial sum
        # By the layer's own size, not the process's group: a single-rank model in a process
        # that also holds a tensor-parallel one must not reduce.
        return tp_all_reduce(out) if self.tp_size > 1 else out
