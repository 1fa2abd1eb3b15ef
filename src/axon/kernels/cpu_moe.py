"""A mixture-of-experts layer's routed experts for a few tokens in one C call (cpu_moe.c).

`ExpertWeights` holds the addresses of every expert's gate, up and down weights (GGML blocks read
in place, or float32 rows), prepared once; calling it with a step's hidden states and routing
returns the weighted sum of the chosen experts. Its reference twin is `fused_moe` in
`axon.layers.fused_moe`, which does the same grouped work from Python, one torch op at a time.
"""

from __future__ import annotations

import ctypes

import torch

from axon.kernels import ggml_cpu, ggml_q8
from axon.kernels.abi import Experts, Router, library
from axon.kernels.cpu_ops import ACTIVATIONS

MAX_TOKENS = ggml_cpu.MAX_TOKENS  # per call; a longer batch (prefill) takes the PyTorch path
_PTRS = ctypes.POINTER(ctypes.c_void_p)


class ExpertWeights:
    """Every expert's weights: `parts[name]` for name in ("gate", "up", "down") is a list of
    (ggml type, tensor holding expert e's weight [N, K] rows, contiguous) per expert. Keeps the
    tensors alive. `hidden` and `inter` are the widths; `activation` a key of ACTIVATIONS. With
    int8 (and formats kernels/ggml_q8.py has) the products take 8-bit activations (`self.int8`),
    at every step size."""

    def __init__(self, parts: dict[str, list[tuple[int, torch.Tensor]]], hidden: int, inter: int,
                 activation: str, int8: bool = False):  # fmt: skip
        self.parts = parts
        gate, up, down = (parts[name] for name in ("gate", "up", "down"))
        self.int8 = int8 and ggml_q8.supports(p[0][0] for p in (gate, up, down))
        self._arrays = [
            (ctypes.c_void_p * len(p))(*(t.data_ptr() for _, t in p)) for p in (gate, up, down)
        ]
        row_bytes = [
            _nbytes(p[0][1]) // rows for p, rows in ((gate, inter), (up, inter), (down, hidden))
        ]
        self._struct = Experts(
            len(gate), hidden, inter, (ctypes.c_int32 * 3)(gate[0][0], up[0][0], down[0][0]),
            ACTIVATIONS[activation], 1, int(self.int8),
            *(ctypes.cast(a, _PTRS) for a in self._arrays),
            (ctypes.c_int64 * 3)(*row_bytes),
        )  # fmt: skip
        # One parallel region covers a step's chosen experts: worth it once one expert's bytes
        # are (the top_k of a step read several).
        expert_bytes = sum(_nbytes(p[0][1]) for p in (gate, up, down))
        self.parallel = expert_bytes >= ggml_cpu.PARALLEL_MIN_BYTES
        self.hidden, self.inter = hidden, inter

    @staticmethod
    def usable(parts: dict[str, list[tuple[int, torch.Tensor]]], activation: str) -> bool:
        """Whether the C call handles these experts: the library built, one format per part
        that the matmul supports, the activation known."""
        if library() is None or activation not in ACTIVATIONS:
            return False
        for part in parts.values():
            types = {ggml_type for ggml_type, _ in part}
            if len(types) != 1 or not ggml_cpu.supports(types.pop()):
                return False
        return True

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """x [T, hidden] float32 (T <= MAX_TOKENS), topk_weights [T, k], topk_ids [T, k] ->
        [T, hidden] float32."""
        x = x.contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        tokens, top_k = ids.shape
        scratch = _scratch_for(tokens * top_k * (2 * self.hidden + 3 * self.inter))
        out = torch.empty(tokens, self.hidden, dtype=torch.float32)
        self._struct.threads = self._threads()
        status = library().axon_moe_experts(
            ctypes.addressof(self._struct), x.data_ptr(), tokens, ids.data_ptr(),
            weights.data_ptr(), top_k, scratch.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"moe experts: bad expert ids or {tokens} tokens > {MAX_TOKENS}")
        return out

    def _threads(self) -> int:
        return torch.get_num_threads() if self.parallel else 1

    def add_block(self, hidden: torch.Tensor, router: MoeRouter) -> torch.Tensor:
        """hidden [T, hidden] float32 contiguous (T <= MAX_TOKENS) += the experts of
        norm(hidden) routed by `router`, in place (the MLP half of a sparse layer); returns
        hidden."""
        lib = library()
        self._struct.threads = self._threads()
        tokens = hidden.shape[0]
        scratch = _scratch_for(lib.axon_moe_block_scratch(self.address, router.address, tokens))
        status = lib.axon_moe_block(
            self.address, router.address, hidden.data_ptr(), tokens, scratch.data_ptr()
        )
        if status != 0:
            raise ValueError(f"moe block: rejected weights or {tokens} tokens > {MAX_TOKENS}")
        return hidden

    @property
    def address(self) -> int:
        """Of the C `Experts` struct (valid while self lives)."""
        return ctypes.addressof(self._struct)


class MoeRouter:
    """A sparse layer's norm before the experts and its float32 router [E, hidden], for
    `ExpertWeights.add_block`. Keeps the tensors alive."""

    def __init__(self, norm, router: torch.Tensor, top_k: int, renormalize: bool):
        self._tensors = (norm.weight, router)
        self._struct = Router(
            norm.weight.data_ptr(), router.data_ptr(), norm.eps, int(norm.unit_offset), top_k,
            int(renormalize),
        )  # fmt: skip
        self.address = ctypes.addressof(self._struct)

    @staticmethod
    def usable(norm, router: torch.Tensor) -> bool:
        """Whether the C block takes them: float32 CPU tensors, widths multiples of 32."""
        tensors = (norm.weight, router)
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            return False
        return router.is_contiguous() and router.shape[1] % 32 == 0


_scratch = torch.empty(0)


def _scratch_for(floats: int) -> torch.Tensor:
    global _scratch
    if _scratch.numel() < floats:
        _scratch = torch.empty(floats, dtype=torch.float32)
    return _scratch


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
