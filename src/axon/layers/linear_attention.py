"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) over per-sequence state slots.

Per token and value head the recurrent state S [Dk, Dv] evolves as
`S <- S * exp(g); S <- S + k (beta * (v - S^T k))^T; o = S^T q` (the gated delta rule). Prefill
uses the equivalent chunked form, decode the recurrent one; both are pure PyTorch here
(`*_ref`), with FLA's Triton kernels behind the same interface on CUDA when installed.

Value heads come in one of two orders, which differ only in which key head each value head
reads: "grouped" (HF checkpoints: value head j reads key head j // (Hv/Hk)) and "tiled" (llama.cpp's
GGUF files, whose converter permutes every value-head tensor so that value head j reads key head
j % Hk). With all value-head weights in the same order either is the same function.

Each running sequence owns a state slot: row `slot` of `conv_state` [slots, C, K-1] (the last
K-1 inputs of the causal depthwise conv) and of `recurrent_state` [slots, Hv, Dk, Dv] (fp32).
A layer reads a sequence's state at the start of its chunk and writes the final state back, so
chunked prefill and decode continue exactly where the previous step stopped. Prefix-cache
snapshots due inside a prompt chunk (`PrefillChunk.state_saves`) split it there: the segments run
in order, each resuming from the state the one before left in its snapshot row, so a snapshot
taken mid-chunk is computed exactly as if the chunk had been cut at it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import get_tp_rank, get_tp_size
from axon.layers.forward_context import PrefillChunk, get_forward_context
from axon.layers.linear import (
    ColumnParallelLinear,
    RegionParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    divide,
    load_regions,
    materialize,
)

try:  # FLA's Triton kernels: an optional GPU fast path with the same semantics
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent
except ImportError:  # pragma: no cover - depends on the environment
    _fla_chunk = _fla_recurrent = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (FLA's and transformers' form)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---- causal depthwise conv1d with carried state -----------------------------------------------


def causal_conv1d_ref(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor | None,  # [C, K-1] inputs before x, or None for zeros
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of one sequence's chunk -> (out [T, C], new state [C, K-1])."""
    channels, kernel = weight.shape
    if conv_state is None:
        conv_state = x.new_zeros(channels, kernel - 1)
    padded = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    out = F.conv1d(padded[None], weight[:, None, :], groups=channels)[0]  # [C, T]
    return F.silu(out).t(), padded[:, padded.shape[1] - (kernel - 1) :]


def causal_conv1d_update_ref(
    x: torch.Tensor,  # [B, C] one new token per sequence
    conv_state: torch.Tensor,  # [B, C, K-1]
    weight: torch.Tensor,  # [C, K]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the conv for a batch of sequences -> (out [B, C], state [B, C, K-1])."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    out = (window * weight[None]).sum(-1)
    return F.silu(out), window[:, :, 1:]


# ---- the gated delta rule ---------------------------------------------------------------------


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,  # [B, T, H, Dk] l2-normalised
    k: torch.Tensor,  # [B, T, H, Dk] l2-normalised
    v: torch.Tensor,  # [B, T, H, Dv]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H]
    scale: float,
    initial_state: torch.Tensor | None = None,  # [B, H, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule -> (o [B, T, H, Dv] in v's dtype, final state fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * scale
    batch, heads, length, k_dim = k.shape
    if initial_state is None:
        state = q.new_zeros(batch, heads, k_dim, v.shape[-1])
    else:
        state = initial_state.float()
    out = torch.empty_like(v)
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(-2)  # [B, H, Dv]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).to(dtype), state


def _chunk_prepare(q, k, v, g, beta, scale: float, chunk_size: int):
    """Pad to whole chunks and build the intra-chunk terms (the UT transform)."""
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [B, H, T, ...]
    pad = (-q.shape[2]) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    shape = (*q.shape[:2], -1, chunk_size)  # [B, H, N, C]
    q, k = (x.reshape(*shape, x.shape[-1]) for x in (q * scale, k))
    v_beta = (v * beta[..., None]).reshape(*shape, v.shape[-1])
    k_beta = k * beta.reshape(shape)[..., None]
    g = g.reshape(shape).cumsum(-1)  # cumulative log decay inside each chunk
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = k_beta * g.exp()[..., None]
    k_cumdecay = torch.linalg.solve_triangular(system, k_decayed, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    return q, k, g, values, k_cumdecay, intra


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,  # [B, T, H, Dk] l2-normalised
    k: torch.Tensor,  # [B, T, H, Dk] l2-normalised
    v: torch.Tensor,  # [B, T, H, Dv]
    g: torch.Tensor,  # [B, T, H]
    beta: torch.Tensor,  # [B, T, H]
    scale: float,
    initial_state: torch.Tensor | None = None,  # [B, H, Dk, Dv]
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule a chunk at a time (transformers' torch_chunk_gated_delta_rule) ->
    (o [B, T, H, Dv], final state [B, H, Dk, Dv] fp32)."""
    length, dtype = q.shape[1], v.dtype
    q, k, g, values, k_cumdecay, intra = _chunk_prepare(q, k, v, g, beta, scale, chunk_size)
    batch, heads, num_chunks = q.shape[:3]
    if initial_state is None:
        state = q.new_zeros(batch, heads, k.shape[-1], values.shape[-1])
    else:
        state = initial_state.float()
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    out = torch.empty_like(values)  # [B, H, N, C, Dv]
    for i in range(num_chunks):
        v_new = values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, out.shape[-1])[:, :, :length]
    return out.transpose(1, 2).to(dtype), state


_TOKEN_BY_TOKEN = 8  # segments up to this many tokens take the recurrent form


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float, initial_state=None):
    """Prefill form; FLA's kernel on CUDA when installed, else the reference."""
    if _fla_chunk is not None and q.is_cuda:
        return _fla_chunk(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True
        )
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale: float, initial_state=None):
    """Decode form; FLA's kernel on CUDA when installed, else the reference."""
    if _fla_recurrent is not None and q.is_cuda:
        return _fla_recurrent(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True
        )
    return recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state)


# ---- the mixer --------------------------------------------------------------------------------


class RMSNormGated(nn.Module):
    """RMSNorm(x) * w * silu(gate), norm before gate (Qwen3NextRMSNormGated; weight init 1)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class DepthwiseConv1d(nn.Module):
    """Holds the conv weight [C, 1, K] under the checkpoint's name (`conv1d.weight`)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)


VALUE_HEAD_ORDERS = ("grouped", "tiled")


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer: [T, hidden] -> [T, hidden] over state slots.

    `value_head_order` is the order of the value heads in the weights ("grouped" for an HF
    checkpoint, "tiled" for a llama.cpp GGUF; see the module docstring). The decay rate is held
    as `A = -exp(A_log)`, the form GGUF stores; an HF checkpoint's `A_log` is converted on load.
    """

    def __init__(self, config, value_head_order: str = "grouped"):
        super().__init__()
        if value_head_order not in VALUE_HEAD_ORDERS:
            raise ValueError(
                f"value_head_order must be one of {VALUE_HEAD_ORDERS}, got {value_head_order!r}"
            )
        self.value_head_order = value_head_order
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if value_head_order == "tiled" and self.tp_size > 1:
            raise ValueError("tiled value heads (GGUF) need tensor-parallel size 1")
        hidden = config.hidden_size
        # This rank's heads: key heads and the value heads that read them ("grouped" order
        # keeps them together), so every head's state lives on one rank.
        self.num_k_heads = divide(config.linear_num_key_heads, self.tp_size)
        self.num_v_heads = divide(config.linear_num_value_heads, self.tp_size)
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.scale = self.head_k_dim**-0.5
        # The fused projection and the conv channels are q | k | v: each region splits by head.
        total_key_dim, total_value_dim = self.key_dim * self.tp_size, self.value_dim * self.tp_size
        self.regions = [total_key_dim, total_key_dim, total_value_dim]
        self.in_proj_qkv = RegionParallelLinear(hidden, self.regions)
        self.in_proj_z = ColumnParallelLinear(hidden, total_value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden, config.linear_num_value_heads)
        self.in_proj_a = ColumnParallelLinear(hidden, config.linear_num_value_heads)
        self.conv1d = DepthwiseConv1d(self.conv_dim, self.conv_kernel_size)
        self.conv1d.weight.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.dt_bias.weight_loader = self._load_per_head
        decay = torch.full((self.num_v_heads,), -1.0, dtype=torch.float32)  # fp32 in any dtype
        self.A = nn.Parameter(decay, requires_grad=False)
        self.A.weight_loader = self._load_decay
        self.norm = RMSNormGated(self.head_v_dim, config.rms_norm_eps)  # per head: local
        self.out_proj = RowParallelLinear(total_value_dim, hidden)
        self.conv_state = torch.empty(0)  # [slots, C, K-1], bound by the runner
        self.recurrent_state = torch.empty(0)  # [slots, Hv, Dk, Dv] fp32, bound by the runner

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_regions(param, loaded, self.regions, self.tp_rank, self.tp_size)

    def _load_per_head(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A per-value-head vector: this rank's heads of it."""
        if self.tp_size > 1:
            loaded = loaded.narrow(0, self.tp_rank * self.num_v_heads, self.num_v_heads)
        default_weight_loader(param, loaded)

    def _load_decay(self, param: nn.Parameter, loaded: torch.Tensor, form=None) -> None:
        """Load `A` itself, or (form "A_log") `-exp(A_log)` exactly as transformers computes it:
        A_log held in the model dtype (dt_bias's), exponentiated in fp32."""
        if self.tp_size > 1:
            loaded = loaded.narrow(0, self.tp_rank * self.num_v_heads, self.num_v_heads)
        if form == "A_log":
            loaded = -materialize(loaded).to(self.dt_bias.dtype).float().exp()
        default_weight_loader(param, loaded)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of the conv state and the recurrent state."""
        conv = (self.conv_dim, self.conv_kernel_size - 1)
        return conv, (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        num_tokens = hidden.shape[0]
        mixed = self.in_proj_qkv(hidden)  # [T, C]
        z = self.in_proj_z(hidden).view(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden).sigmoid()  # [T, Hv]
        a = self.in_proj_a(hidden).float()
        g = self.A * F.softplus(a + self.dt_bias.float())  # [T, Hv]
        core = hidden.new_empty(num_tokens, self.num_v_heads, self.head_v_dim)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            core[rows] = self._prefill(chunk, mixed[rows], g[rows], beta[rows])
        if meta.decode_token_index is not None:
            rows = meta.decode_token_index
            core[rows] = self._decode(meta.decode_state_slots, mixed[rows], g[rows], beta[rows])
        core = self.norm(core, z)
        return self.out_proj(core.view(num_tokens, -1))

    def _heads(self, mixed: torch.Tensor):
        """Split conv output [N, C] into q, k [N, Hv, Dk] (l2-normalised, expanded to the value
        heads in `value_head_order`) and v [N, Hv, Dv]."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(-1, self.num_k_heads, self.head_k_dim))  # [N, Hk, Dk]
        k = l2norm(k.reshape(-1, self.num_k_heads, self.head_k_dim))
        ratio = self.num_v_heads // self.num_k_heads
        if ratio > 1 and self.value_head_order == "grouped":  # value head j reads j // ratio
            q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        elif ratio > 1:  # tiled: value head j reads key head j % Hk
            q, k = q.repeat(1, ratio, 1), k.repeat(1, ratio, 1)
        return q, k, v.reshape(-1, self.num_v_heads, self.head_v_dim)

    def _prefill(self, chunk: PrefillChunk, mixed, g, beta) -> torch.Tensor:
        """One sequence's chunk [Q, ...] -> core output [Q, Hv, Dv]; leaves the final state in
        its slot and the state at each snapshot point inside the chunk in that snapshot's row."""
        if not chunk.state_saves:
            return self._prefill_segment(mixed, g, beta, chunk.state_slot, chunk.has_initial_state)
        outs, start, source, resume = [], 0, chunk.state_slot, chunk.has_initial_state
        for end, row in [*chunk.state_saves, (chunk.query_len, chunk.state_slot)]:
            rows = slice(start, end)
            # Read back from the row written last, as the next step would after a cut there.
            outs.append(
                self._prefill_segment(mixed[rows], g[rows], beta[rows], source, resume, row)
            )
            start, source, resume = end, row, True
        return torch.cat(outs)

    def _prefill_segment(
        self, mixed, g, beta, source: int, resume: bool, dest: int | None = None
    ) -> torch.Tensor:
        """Run tokens [N, ...] from the state in row `source` (zeros unless `resume`), writing
        the state after them to row `dest` (default `source`) -> core output [N, Hv, Dv]."""
        dest = source if dest is None else dest
        weight = self.conv1d.weight[:, 0]  # [C, K]
        conv_in = self.conv_state[source] if resume else None
        mixed, self.conv_state[dest] = causal_conv1d_ref(mixed, weight, conv_in)
        q, k, v = self._heads(mixed)
        initial = self.recurrent_state[source : source + 1] if resume else None
        # The chunk rule pads every segment to 64 tokens: the few tokens of a verify chunk's
        # per-draft segments run token by token instead (benchmarks/gdn_draft_states.py).
        rule = recurrent_gated_delta_rule if len(g) <= _TOKEN_BY_TOKEN else chunk_gated_delta_rule
        out, state = rule(q[None], k[None], v[None], g[None], beta[None], self.scale, initial)
        self.recurrent_state[dest] = state[0]
        return out[0]

    def _decode(self, slots: torch.Tensor, mixed, g, beta) -> torch.Tensor:
        weight = self.conv1d.weight[:, 0]
        mixed, conv = causal_conv1d_update_ref(mixed, self.conv_state[slots], weight)
        self.conv_state.index_copy_(0, slots, conv.to(self.conv_state.dtype))
        q, k, v = self._heads(mixed)
        out, state = recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], self.scale,
            self.recurrent_state[slots],
        )  # fmt: skip
        self.recurrent_state.index_copy_(0, slots, state)
        return out[:, 0]
