"""Routed mixture-of-experts: a float32 top-k router and SwiGLU experts held as 3-D parameters.

`FusedMoE` holds every expert of a layer the way transformers does: `gate_up_proj` [E, 2I, H]
(each expert's gate rows, then its up rows) and `down_proj` [E, H, I]. Checkpoints store them
either so (`experts.gate_up_proj`, loaded whole) or one expert at a time
(`experts.N.gate_proj.weight`, ...), which `expert_packed_mapping` declares as shards of the 3-D
parameters for the loader's `packed_modules_mapping`.

`fused_moe` groups a step's tokens by expert: each chosen expert's weights are read once for all
the tokens routed to it, and an expert nobody chose is not read at all. Its reference twin
`fused_moe_ref` is the obvious per-token loop. On the CPU, a step of at most 64 tokens (decode)
runs the same grouped work in one C call (kernels/cpu_moe.py): from Python it costs ~10 torch ops
per chosen expert, at batch 1 as long as reading the expert's weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from axon.kernels import cpu_moe, ggml_cpu
from axon.layers.activation import get_act_and_mul
from axon.layers.linear import SmallBatchLinear, default_weight_loader, divide, materialize
from axon.layers.quantized import QuantizedTensor, matmul_ref

ExpertMatmul = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, x [n, K]) -> [n, N]
ExpertParts = dict[str, list[tuple[int, torch.Tensor]]]  # part -> (ggml type, weight) per expert
# Activations of the C path (cpu_ops.ACTIVATIONS) by config name.
_C_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# A per-expert checkpoint tensor `experts.N.<name>.weight` -> (3-D parameter, part of it).
EXPERT_CHECKPOINT_PARTS = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
}


def expert_packed_mapping(num_experts: int) -> dict[str, tuple[str, tuple[int, str]]]:
    """`packed_modules_mapping` entries that load `experts.N.gate_proj.weight` (and up, down)
    as shard (N, "gate") of `experts.gate_up_proj`."""
    return {
        f"experts.{expert}.{name}.weight": (f"experts.{param}", (expert, part))
        for expert in range(num_experts)
        for name, (param, part) in EXPERT_CHECKPOINT_PARTS.items()
    }


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k: (weights [T, k] float32, expert ids [T, k] int64) of logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TopKRouter(nn.Module):
    """`gate`: hidden -> expert logits, kept and computed in float32 whatever the model dtype,
    since a bf16 router flips near-tied expert choices."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        weight = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded) -> None:
        if isinstance(loaded, QuantizedTensor):  # tiny: kept dense
            loaded = loaded.dequantize()
        default_weight_loader(param, materialize(loaded).float())

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.weight)  # [T, E]
        return select_experts(logits, self.top_k, self.renormalize)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor]]:
    """(expert, routed slots) for every expert chosen at least once, in ascending expert order;
    a slot indexes the flattened [T * k] choices (token = slot // k)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T * k], slots grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, order[start : start + count]))
            start += count
    return groups


def fused_moe(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: ExpertMatmul,
    down: ExpertMatmul,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """sum_j w[t, j] * expert_{ids[t, j]}(hidden[t]) for hidden [T, H] -> [T, H] in hidden's
    dtype, accumulated in float32. `gate_up(e, x)` and `down(e, x)` run expert e's
    projections; each is called once per chosen expert, never for an unchosen one."""
    top_k = topk_ids.shape[1]
    flat_weights = topk_weights.reshape(-1, 1).float()  # [T * k, 1]
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for expert, slots in group_by_expert(topk_ids, num_experts):
        tokens = slots // top_k
        x = hidden.index_select(0, tokens)  # [n, H]
        y = down(expert, act_and_mul(gate_up(expert, x)))  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[slots])
    return out.to(hidden.dtype)


def fused_moe_ref(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference twin of `fused_moe` with SiLU experts: one token and one choice at a
    time. w_gate_up [E, 2I, H], w_down [E, H, I]; returns [T, H] in hidden's dtype."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for token in range(hidden.shape[0]):
        x = hidden[token].float()
        for weight, expert in zip(topk_weights[token].tolist(), topk_ids[token].tolist()):
            gate, up = (w_gate_up[expert].float() @ x).chunk(2)
            out[token] += weight * (w_down[expert].float() @ (F.silu(gate) * up))
    return out.to(hidden.dtype)


class QuantizedExperts(nn.Module):
    """A layer's experts kept in their GGUF blocks (each part a view of the file's one copy),
    multiplied in place by the C kernel (kernels/ggml_cpu.py) with float32 activations; where
    it cannot (no compiler, an unsupported type) a part is dequantized per call, the reference
    twin `matmul_ref`. An expert's gate and up parts run as one call. `int8` (set by
    use_int8_activations before the first forward) switches every product, the one-call C
    experts' included, to 8-bit activations (kernels/ggml_q8.py)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.int8 = False
        self._parts: dict[tuple[int, str], QuantizedTensor] = {}
        self._prepared: dict[tuple[int, str], ggml_cpu.GGMLWeights | None] = {}

    def add(self, expert: int, part: str, qt: QuantizedTensor) -> None:
        self.register_buffer(f"{part}_{expert}", qt.data)  # counted in the model's bytes
        self._parts[expert, part] = qt

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(expert, "gate_up", ("gate", "up"), x)  # [n, 2I]

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(expert, "down", ("down",), x)  # [n, H]

    def _matmul(self, expert: int, key: str, parts: tuple[str, ...], x: torch.Tensor):
        qts = [self._part(expert, part) for part in parts]
        if (expert, key) not in self._prepared:
            supported = all(ggml_cpu.supports(qt.ggml_type) for qt in qts)
            weights = [(qt.ggml_type, qt.data) for qt in qts]
            kernel = (
                ggml_cpu.GGMLWeights(weights, qts[0].shape[1], self.int8) if supported else None
            )
            self._prepared[expert, key] = kernel
        kernel = self._prepared[expert, key]
        if kernel is not None and x.device.type == "cpu":
            return kernel.matmul(x).to(x.dtype)
        return torch.cat([matmul_ref(x, qt) for qt in qts], dim=-1)

    def c_parts(self) -> ExpertParts:
        """Every expert's blocks by part, for cpu_moe.ExpertWeights."""
        experts = range(self.num_experts)
        return {
            part: [(self._part(e, part).ggml_type, self._part(e, part).data) for e in experts]
            for part in ("gate", "up", "down")
        }

    def _part(self, expert: int, part: str) -> QuantizedTensor:
        qt = self._parts.get((expert, part))
        if qt is None:
            raise ValueError(f"quantized experts: expert {expert} has no {part} weight")
        return qt


class FusedMoE(nn.Module):
    """`experts`: the routed SwiGLU experts of one layer (see the module docstring).

    Under tensor parallelism every rank holds every expert, cut along its intermediate
    dimension: its 1/tp_size of the gate and up rows and of the down columns (as
    RowParallelLinear after MergedColumnParallelLinear), so `forward` returns this rank's
    partial sum, which the block all-reduces. `intermediate_size` is this rank's width."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, act: str
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate_size = divide(intermediate_size, self.tp_size)
        intermediate_size = self.intermediate_size
        shapes = {
            "gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
            "down_proj": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape), requires_grad=False)
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)
        self.act_fn = get_act_and_mul(act)
        self.quantized: QuantizedExperts | None = None
        # Per expert and projection: float32 decode rows on the C kernel, else F.linear.
        self._linears = [(SmallBatchLinear(), SmallBatchLinear()) for _ in range(num_experts)]
        self.act = act
        self._c_experts: cpu_moe.ExpertWeights | None | bool = False  # False: not prepared

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Load the whole 3-D tensor (shard_id None) or one expert's part: (expert, "gate" |
        "up" | "down"). A GGUF part stays quantized (see QuantizedExperts)."""
        self._c_experts = False  # the weights' addresses may change
        if isinstance(loaded, QuantizedTensor):
            self._load_quantized(loaded, shard_id)
            return
        if shard_id is None:
            self._load_stacked(param, loaded)
            return
        expert, part = shard_id
        target = param.data[expert]
        if part in ("gate", "up"):
            inter = self.intermediate_size
            target = target.narrow(0, 0 if part == "gate" else inter, inter)
        default_weight_loader(target, self._rank_shard(loaded, part, 1 if part == "down" else 0))

    def _load_quantized(self, loaded: QuantizedTensor, shard_id) -> None:
        if shard_id is None:
            raise ValueError("quantized experts load one expert at a time")
        if self.quantized is None:
            self.quantized = QuantizedExperts(self.num_experts)
            for dense in (self.gate_up_proj, self.down_proj):
                dense.data = torch.empty(0, dtype=dense.dtype, device=dense.device)
        expert, part = shard_id
        shard = self._rank_shard(loaded, part, 1 if part == "down" else 0)
        # A rank copies its shard out of the mapped file; one rank keeps the views.
        self.quantized.add(expert, part, shard.owned() if self.tp_size > 1 else shard)

    def _load_stacked(self, param: nn.Parameter, loaded) -> None:
        """A whole 3-D checkpoint tensor: gate_up [E, 2I, H] (this rank's rows of the gate
        half, then of the up half) or down [E, H, I] (this rank's columns)."""
        if self.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        if param is self.down_proj:
            default_weight_loader(param, self._rank_shard(loaded, "down", 2))
            return
        inter, full = self.intermediate_size, self.intermediate_size * self.tp_size
        if loaded.shape[1] != 2 * full:
            raise ValueError(f"shape mismatch: gate_up_proj {tuple(loaded.shape)}, {2 * full} rows")
        for half, part in enumerate(("gate", "up")):
            whole = loaded.narrow(1, half * full, full)
            target = param.data.narrow(1, half * inter, inter)
            default_weight_loader(target, self._rank_shard(whole, part, 1))

    def _rank_shard(self, loaded, part: str, dim: int):
        """This rank's 1/tp_size of the intermediate dimension `dim` of one checkpoint part
        (a tensor, a lazy CheckpointSlice or a QuantizedTensor, whose column cut must fall on
        whole quant blocks); the part itself with one rank."""
        if self.tp_size == 1:
            return loaded
        inter = self.intermediate_size
        if loaded.shape[dim] != inter * self.tp_size:
            raise ValueError(
                f"shape mismatch: expert {part} {tuple(loaded.shape)}, expected "
                f"{inter * self.tp_size} on dim {dim} (moe_intermediate_size)"
            )
        return loaded.narrow(dim, self.tp_rank * inter, inter)

    def inactive_bytes(self) -> int:
        """Bytes of the experts one token does not read: all but `top_k` of them."""
        held = sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))
        return held * (self.num_experts - self.top_k) // self.num_experts

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        c_experts = self._c_path(hidden)
        if c_experts is not None:
            return c_experts(hidden.float(), topk_weights, topk_ids).to(hidden.dtype)
        if self.quantized is not None:
            gate_up, down = self.quantized.gate_up, self.quantized.down
            return fused_moe(
                hidden, topk_weights, topk_ids, gate_up, down, self.act_fn, self.num_experts
            )
        gate_up, down, linears = self.gate_up_proj, self.down_proj, self._linears
        return fused_moe(
            hidden, topk_weights, topk_ids,
            lambda expert, x: linears[expert][0](x, gate_up[expert]),
            lambda expert, x: linears[expert][1](x, down[expert]),
            self.act_fn, self.num_experts,
        )  # fmt: skip

    def _c_path(self, hidden: torch.Tensor) -> cpu_moe.ExpertWeights | None:
        """The one-call C experts for this step (prepared on first use), or None: not the CPU,
        more than cpu_moe.MAX_TOKENS tokens, or experts the C matmul does not take (dense ones
        must be float32 with widths a multiple of 32)."""
        if hidden.device.type != "cpu" or hidden.shape[0] > cpu_moe.MAX_TOKENS:
            return None
        if self._c_experts is False:
            parts = self._c_parts()
            activation = _C_ACTIVATIONS.get(self.act)
            usable = parts is not None and cpu_moe.ExpertWeights.usable(parts, activation)
            inter, int8 = self.intermediate_size, self.quantized is not None and self.quantized.int8
            self._c_experts = (
                cpu_moe.ExpertWeights(parts, hidden.shape[1], inter, activation, int8)
                if usable
                else None
            )
        return self._c_experts

    def _c_parts(self) -> ExpertParts | None:
        if self.quantized is not None:
            return self.quantized.c_parts()
        gate_up, down, inter = self.gate_up_proj.data, self.down_proj.data, self.intermediate_size
        if gate_up.dtype != torch.float32 or not (gate_up.is_contiguous() and down.is_contiguous()):
            return None
        if down.shape[1] % 32 or inter % 32:  # the C matmul's float32 "blocks"
            return None
        experts = range(self.num_experts)
        return {
            "gate": [(ggml_cpu.F32, gate_up[e, :inter].view(torch.uint8)) for e in experts],
            "up": [(ggml_cpu.F32, gate_up[e, inter:].view(torch.uint8)) for e in experts],
            "down": [(ggml_cpu.F32, down[e].view(torch.uint8)) for e in experts],
        }


class SparseMoeBlock(nn.Module):
    """`mlp` of a sparse layer: the router `gate` (replicated on every rank) and the routed
    `experts` (each rank its share of every expert's intermediate dimension)."""

    def __init__(self, config, renormalize: bool):
        super().__init__()
        num_experts, top_k = config.num_experts, config.num_experts_per_tok
        self.gate = TopKRouter(config.hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedMoE(
            num_experts, top_k, config.hidden_size, config.moe_intermediate_size, config.hidden_act
        )
        self._c_router: tuple[tuple[int, int], cpu_moe.MoeRouter | None] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.partial(hidden)  # [T, H]
        # By the layer's own size, not the process's group (see RowParallelLinear.forward).
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output [T, H] (the whole of it with one rank):
        every rank routes the same tokens to the same experts, each computing its slice."""
        topk_weights, topk_ids = self.gate(hidden)  # [T, k] each
        return self.experts(hidden, topk_weights, topk_ids)

    def add_in_place(self, hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
        """`hidden + self(norm(hidden))` computed in place in `hidden` by one C call (norm,
        router, top-k, experts; a decode step on the CPU in float32) and returned, or None
        (hidden untouched) where that path does not apply. Its reference twin is forward.
        Not under tensor parallelism: the partials must be summed before the residual add."""
        if hidden.dim() != 2 or hidden.dtype != torch.float32 or not hidden.is_contiguous():
            return None
        c_block = self.c_block(hidden, norm)
        return None if c_block is None else c_block[0].add_block(hidden, c_block[1])

    def c_block(
        self, hidden: torch.Tensor, norm: nn.Module
    ) -> tuple[cpu_moe.ExpertWeights, cpu_moe.MoeRouter] | None:
        """The C experts and router (`norm` before it) that run this block in one call, or None:
        tensor parallelism, or no C path for the experts or the router."""
        if self.experts.tp_size > 1:
            return None
        experts = self.experts._c_path(hidden)
        router = self._router_for(norm) if experts is not None else None
        return None if router is None else (experts, router)

    def _router_for(self, norm: nn.Module) -> cpu_moe.MoeRouter | None:
        """The C router (built once, again if a weight moved), or None where unsupported."""
        key = (norm.weight.data_ptr(), self.gate.weight.data_ptr())
        if self._c_router is None or self._c_router[0] != key:
            usable = cpu_moe.MoeRouter.usable(norm, self.gate.weight)
            gate = self.gate
            router = (
                cpu_moe.MoeRouter(norm, gate.weight, gate.top_k, gate.renormalize)
                if usable
                else None
            )
            self._c_router = (key, router)
        return self._c_router[1]
