"""GGUF weights kept in their quantized form: the holder, the matmul methods, the embedding.

`QuantizedTensor` is what the GGUF loader yields for a weight that stays quantized. A layer that
receives one builds a `QuantizedMatmul`, which picks the kernel for the format:

- ggml:    Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K read in place from the GGUF bytes
           with float32 activations by a small C kernel (kernels/ggml_cpu.py): no second copy,
           and the same float32 math as transformers on the dequantized weights (or with 8-bit
           activations, kernels/ggml_q8.py, when the model runs activation_precision="int8");
- int4:    the same formats through torch's int4 weight-only kernel with bf16 activations, where
           the C kernel cannot be built (no C compiler; see kernels/ggml_int4.py);
- dense:   F16 / BF16 kept in their own dtype, activations cast to it;
- dequant: any other supported format (Q2_K, Q3_K where the C kernel cannot be built),
           dequantized on every call: correct, slow.

Every path has the same reference twin: `F.linear(x, qt.dequantize())`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from axon.kernels import ggml_cpu
from axon.kernels.ggml_dequant import dequantize_rows_ref
from axon.kernels.ggml_int4 import INT4_TYPES, Int4Weight, int4_matmul, repack_int4

T = GGMLQuantizationType
_DENSE_DTYPES = {T.F16: torch.float16, T.BF16: torch.bfloat16}


@dataclass
class QuantizedTensor:
    """A GGML tensor as stored: raw blocks and the logical (HF) shape."""

    ggml_type: int
    data: torch.Tensor  # [rows, row_bytes] uint8
    shape: tuple[int, int]  # [rows, cols], HF order (out_features, in_features)

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def block_size(self) -> int:
        """Columns per quant block (1 for F16 / BF16): a column slice must be whole blocks."""
        return GGML_QUANT_SIZES[T(self.ggml_type)][0]

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (dim 0) or columns (dim 1, whole quant blocks only) [start, start + length) as
        a view of the same bytes: a tensor-parallel rank's shard, read from the mapped file
        only when copied (`owned`). Raises ValueError naming the sizes when the columns do not
        fall on block boundaries or the range is outside the tensor."""
        rows, cols = self.shape
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside shape {self.shape}")
        if dim == 0:
            rows_data = self.data[start : start + length]
            return QuantizedTensor(self.ggml_type, rows_data, (length, cols))
        block, block_bytes = GGML_QUANT_SIZES[T(self.ggml_type)]
        if start % block or length % block:
            raise ValueError(
                f"{self.type_name} weight {self.shape}: columns [{start}, {start + length}) "
                f"do not fall on its {block}-column quant blocks"
            )
        first, width = start // block * block_bytes, length // block * block_bytes
        return QuantizedTensor(self.ggml_type, self.data[:, first : first + width], (rows, length))

    def owned(self) -> QuantizedTensor:
        """The same tensor in memory of its own, contiguous (a shard out of the mapped file)."""
        data = self.data.clone(memory_format=torch.contiguous_format)
        return QuantizedTensor(self.ggml_type, data, self.shape)

    def padded(self, rows: int) -> QuantizedTensor:
        """The tensor with zero rows appended up to `rows` (zero bytes dequantize to 0.0 in
        every GGML format): the last rank's vocab shard, as long as the others'."""
        if rows == self.shape[0]:
            return self
        pad = self.data.new_zeros(rows - self.shape[0], self.data.shape[1])
        return QuantizedTensor(self.ggml_type, torch.cat([self.data, pad]), (rows, self.shape[1]))

    @staticmethod
    def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """The parts' rows, in order, in one tensor (a copy)."""
        data = torch.cat([part.data for part in parts])
        return QuantizedTensor(parts[0].ggml_type, data, (data.shape[0], parts[0].shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The whole tensor, float32 [rows, cols]."""
        return dequantize_rows_ref(self.data, self.ggml_type, self.shape[1])

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [n] as float32 [n, cols] (an embedding lookup)."""
        return dequantize_rows_ref(self.data[index], self.ggml_type, self.shape[1])


def matmul_ref(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """The reference twin of every QuantizedMatmul path: x [T, K] -> [T, N] in x's dtype."""
    return F.linear(x.float(), qt.dequantize()).to(x.dtype)


class QuantizedMatmul(nn.Module):
    """y = x @ W.T for one GGUF weight W [N, K], on the fastest exact-enough kernel."""

    def __init__(self, qt: QuantizedTensor):
        super().__init__()
        self.ggml_type = qt.ggml_type
        self.out_features, self.in_features = qt.shape
        self._ggml: ggml_cpu.GGMLWeights | None = None  # the prepared C call, made on first use
        self.int8 = False  # 8-bit activations, every step (use_int8_activations)
        if ggml_cpu.supports(qt.ggml_type):
            self.kind = "ggml"
            self.register_buffer("raw", qt.data)  # the GGUF bytes, shared with an embedding
        elif qt.ggml_type in INT4_TYPES:
            self.kind = "int4"
            weight = repack_int4(qt.data, qt.ggml_type, self.out_features)
            self.register_buffer("packed", weight.packed)
            self.register_buffer("scales_and_zeros", weight.scales_and_zeros)
            self._layout = (weight.piece_width, weight.multipliers)
        elif qt.ggml_type in _DENSE_DTYPES:
            self.kind = "dense"
            self.register_buffer("weight", qt.dequantize().to(_DENSE_DTYPES[qt.ggml_type]))
        else:
            self.kind = "dequant"
            self.register_buffer("raw", qt.data)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype; written into `out` (a [T, N] view, e.g. a column
        slice of a fused layer's output) when one is given."""
        if self.kind == "ggml" and x.device.type == "cpu":
            if self._ggml is None or self._ggml.parts[0][1] is not self.raw:
                weights = [(self.ggml_type, self.raw)]
                self._ggml = ggml_cpu.GGMLWeights(weights, self.in_features, self.int8, pack=True)
            if out is not None and x.dtype == torch.float32:
                return self._ggml.matmul(x, out)
            y = self._ggml.matmul(x).to(x.dtype)
        elif self.kind == "int4":
            weight = Int4Weight(self.packed, self.scales_and_zeros, *self._layout)
            y = int4_matmul(x, weight)  # [T, N]
        elif self.kind == "dense":
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        else:
            w = dequantize_rows_ref(self.raw, self.ggml_type, self.in_features)
            y = F.linear(x, w.to(x.dtype))
        if out is not None:
            out.copy_(y)
            return out
        return y

    def extra_repr(self) -> str:
        name = GGMLQuantizationType(self.ggml_type).name
        return f"{name}, {self.kind}, out={self.out_features}, in={self.in_features}"


class QuantizedParts(nn.Module):
    """The quantized parts of one (possibly fused) linear layer, run as separate matmuls and
    concatenated in `order` (e.g. q, k, v)."""

    def __init__(self, order: list[str]):
        super().__init__()
        self.order = order
        self.parts = nn.ModuleDict()
        self._ggml: ggml_cpu.GGMLWeights | None = None  # all parts in one C call, on CPU
        self._prepared = False
        self.int8 = False  # 8-bit activations, every step (use_int8_activations)

    def add(self, key: str, qt: QuantizedTensor) -> None:
        self.parts[key] = QuantizedMatmul(qt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._prepared:
            self._prepare()
        if self._ggml is not None and x.device.type == "cpu":
            return self._ggml.matmul(x).to(x.dtype)  # every part in one C call
        parts = [self.parts[key] for key in self.order]
        if len(parts) == 1:
            return parts[0](x)
        # Each part writes its columns of one output: no concatenation afterwards.
        width = sum(part.out_features for part in parts)
        out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
        start = 0
        for part in parts:
            part(x, out[:, start : start + part.out_features])
            start += part.out_features
        return out  # [T, sum(N)]

    def ggml_weights(self) -> ggml_cpu.GGMLWeights | None:
        """Every part as one prepared C call, or None when some part is not on that kernel."""
        if not self._prepared:
            self._prepare()
        return self._ggml

    def _prepare(self) -> None:
        self._prepared = True
        missing = [key for key in self.order if key not in self.parts]
        if missing:
            raise ValueError(f"quantized layer is missing parts {missing}")
        parts = [self.parts[key] for key in self.order]
        if all(part.kind == "ggml" and part.raw.device.type == "cpu" for part in parts):
            weights = [(part.ggml_type, part.raw) for part in parts]
            self._ggml = ggml_cpu.GGMLWeights(weights, parts[0].in_features, self.int8, pack=True)


class QuantizedEmbedding(nn.Module):
    """A token embedding kept in GGML form: lookups dequantize only the rows they read; the
    matmul (a tied LM head) is built on first use."""

    def __init__(self, qt: QuantizedTensor):
        super().__init__()
        self.ggml_type, self.shape = qt.ggml_type, qt.shape
        self.register_buffer("raw", qt.data)
        self.matmul: QuantizedMatmul | None = None
        self.int8 = False  # for the tied LM head (use_int8_activations)

    def lookup(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.raw.device.type == "cpu" and ggml_cpu.supports(self.ggml_type):
            rows = ggml_cpu.ggml_dequant(self.raw[input_ids], self.ggml_type, self.shape[1])
            return rows.to(dtype)  # [T, hidden], bit-identical to the reference below
        qt = QuantizedTensor(self.ggml_type, self.raw, self.shape)
        return qt.dequantize_rows(input_ids).to(dtype)  # [T, hidden]

    def build_matmul(self) -> QuantizedMatmul:
        if self.matmul is None:
            self.matmul = QuantizedMatmul(QuantizedTensor(self.ggml_type, self.raw, self.shape))
            self.matmul.int8 = self.int8
        return self.matmul
