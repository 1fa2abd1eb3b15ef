"""Vision tower of Qwen3.5 (`qwen3_5`) and Qwen3-VL (`qwen3_vl`): a ViT over 2-frame patches.

Input is what transformers' Qwen2-VL image processor produces: `pixel_values`
[num_patches, C * T * P * P] (a still image is two identical frames, so T = temporal patch 2)
and `grid_thw` [num_images, 3] in patches. Patches arrive grouped in merge windows: for each
frame, the `merge x merge` windows in raster order, raster order inside each window, so that
four consecutive rows are one LM token for the merger.

Positions: a learned square table bilinearly resampled (align corners) to each image's patch
grid, plus a 2-D rotary over the whole head (half the frequencies from the patch row, half from
the column). Attention is full within one frame of one image (`cu_seqlens`), never across.
Qwen3-VL adds DeepStack: the outputs of `deepstack_visual_indexes` blocks go through their own
mergers and are returned beside the main output, to be added to the first LM layers.

Module names equal the `model.visual.*` checkpoint keys, so the loader routes
`model.visual.<name>` straight into `load_weights`. The tower is replicated, not sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from axon.models.weights import load_weights as route_weights

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float], torch.Tensor]
LAYER_NORM_EPS = 1e-6


def merged_token_counts(grid_thw: Sequence[Sequence[int]], spatial_merge_size: int) -> list[int]:
    """LM tokens each image yields: t * h * w / merge**2 (its share of the tower's output)."""
    return [t * h * w // spatial_merge_size**2 for t, h, w in grid_thw]


def window_order_coords(height: int, width: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of one frame in the processor's merge-window order; [h*w] each."""
    blocks_h, blocks_w = height // merge, width // merge
    rows = torch.arange(height).view(blocks_h, 1, merge, 1).expand(-1, blocks_w, -1, merge)
    cols = torch.arange(width).view(1, blocks_w, 1, merge).expand(blocks_h, -1, merge, -1)
    return rows.reshape(-1), cols.reshape(-1)  # [h/m, w/m, m, m] flattened


def patch_coords(grid_thw: Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch of every image, frames repeating their image's grid; [N, 2]."""
    per_image = []
    for t, h, w in grid_thw:
        rows, cols = window_order_coords(h, w, merge)
        per_image.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(per_image)


def frame_cu_seqlens(grid_thw: Sequence[Sequence[int]]) -> list[int]:
    """Token boundaries of each frame of each image: [num_frames + 1]; attention stays inside."""
    bounds = [0]
    for t, h, w in grid_thw:
        bounds += [bounds[-1] + h * w * (i + 1) for i in range(t)]
    return bounds


def bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries an axis position reads and their weights, `F.interpolate`'s bilinear
    with align_corners (the ends of the image axis map to the ends of the table); [n, 2] each."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    floor = source.floor()
    taps = torch.stack([floor, floor + 1], dim=-1).long().clamp(max=side - 1)
    frac = source - floor
    return taps, torch.stack([1 - frac, frac], dim=-1)


def position_table_taps(
    grid_thw: Sequence[Sequence[int]], side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the flattened `side x side` position table and their bilinear weights for
    every patch, in the patches' order; [N, 4] each."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        rows, cols = window_order_coords(h, w, merge)
        row_taps, row_weights = bilinear_taps(rows, h, side)  # [h * w, 2]
        col_taps, col_weights = bilinear_taps(cols, w, side)
        indices.append(
            (row_taps[:, :, None] * side + col_taps[:, None, :]).view(-1, 4).repeat(t, 1)
        )
        weights.append((row_weights[:, :, None] * col_weights[:, None, :]).view(-1, 4).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


def rotary_cos_sin(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """cos and sin of the 2-D rotary angles, [N, head_dim] fp32: head_dim / 4 frequencies, driven
    by the row then by the column, the pair repeated for the two rotate-half halves."""
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=coords.device) / half
    inv_freq = 1.0 / theta**exponents  # [D/4]
    angles = (coords.float()[..., None] * inv_freq).flatten(1)  # [N, 2, D/4] -> [N, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, D]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [T, H, D] in fp32 (bf16 angles drift on large grids)."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Bidirectional attention within each [cu_seqlens[i], cu_seqlens[i+1]) segment, one SDPA
    call per segment (no padding between images); q, k, v [T, H, D] -> [T, H * D]. The
    segments go in as [1, H, S, D]: only 4-D inputs take the CPU's flash kernel (3-D ones
    materialise the S x S scores)."""
    outputs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        q_seg, k_seg, v_seg = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, scale=scale)  # [1, H, S, D]
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs).flatten(1)


def varlen_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Pure-PyTorch twin of `varlen_attention`: one fp32 softmax over all tokens under a
    block-diagonal mask; q, k, v [T, H, D] -> [T, H * D]."""
    lengths = torch.tensor(cu_seqlens).diff()
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(q.device)  # [T]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, T, T]
    scores = scores.masked_fill(segment[:, None] != segment[None, :], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v.float())  # [T, H, D]
    return out.flatten(1).to(q.dtype)


class VisionPatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # Kernel == stride and one patch per row, so the conv is a single matmul per patch.
        weight = self.proj.weight.view(self.proj.out_channels, -1)  # [E, C * T * P * P]
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)  # [N, E]


class VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, attention_fn: AttentionFn):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.attention_fn = attention_fn
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden, cos, sin, cu_seqlens: list[int]) -> torch.Tensor:
        qkv = self.qkv(hidden).view(hidden.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # [T, H, D] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_fn(q, k, v, cu_seqlens, self.head_dim**-0.5)  # [T, H * D]
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = gelu_approximation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(hidden), approximate=self.approximate))


def gelu_approximation(hidden_act: str) -> str:
    """`F.gelu`'s `approximate` for a config's `hidden_act`."""
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "tanh"
    if hidden_act == "gelu":
        return "none"
    raise ValueError(f"unsupported vision hidden_act {hidden_act!r}")


class VisionBlock(nn.Module):
    def __init__(self, config, attention_fn: AttentionFn):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, attention_fn)
        self.mlp = VisionMLP(config)

    def forward(self, hidden, cos, sin, cu_seqlens: list[int]) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), cos, sin, cu_seqlens)
        return hidden + self.mlp(self.norm2(hidden))


class VisionPatchMerger(nn.Module):
    """Four patches of a merge window -> one LM-width token. The main merger normalises each
    patch before the concat; DeepStack's (`postshuffle_norm`) normalises the concatenation."""

    def __init__(self, config, postshuffle_norm: bool):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        norm_size = self.merged_size if postshuffle_norm else config.hidden_size
        self.norm = nn.LayerNorm(norm_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            merged = self.norm(hidden.view(-1, self.merged_size))  # [N / m^2, m^2 * E]
        else:
            merged = self.norm(hidden).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))  # [N / m^2, lm_hidden]


class Qwen3_5VisionTower(nn.Module):
    """The `model.visual` of Qwen3.5 and (with `deepstack_visual_indexes`) of Qwen3-VL.

    `config` is the checkpoint's `vision_config`. `attention_fn` picks the varlen attention
    (`varlen_attention_ref` is the pure-PyTorch twin the tests compare against).
    """

    tie_word_embeddings = False  # read by the shared weight router

    def __init__(self, config, attention_fn: AttentionFn = varlen_attention):
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.head_dim = config.hidden_size // config.num_heads
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rope_parameters.get("rope_theta", 10000.0))
        self.table_side = int(config.num_position_embeddings**0.5)
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.patch_embed = VisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config, attention_fn) for _ in range(config.depth))
        self.merger = VisionPatchMerger(config, postshuffle_norm=False)
        # Qwen3.5 configs drop the attribute; Qwen3-VL's lists the blocks that feed DeepStack.
        indexes = getattr(config, "deepstack_visual_indexes", None) or []
        self.deepstack_visual_indexes = list(indexes)
        if indexes:
            self.deepstack_merger_list = nn.ModuleList(
                VisionPatchMerger(config, postshuffle_norm=True) for _ in indexes
            )

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(embeddings [num_merged_tokens, lm_hidden], DeepStack features: one tensor of that
        shape per `deepstack_visual_indexes` entry, [] for Qwen3.5), images in `grid_thw` order."""
        grids = self.check_inputs(pixel_values, grid_thw)
        hidden = self.patch_embed(pixel_values)  # [N, E]
        hidden = hidden + self.interpolated_positions(grids).to(hidden.dtype)
        coords = patch_coords(grids, self.spatial_merge_size).to(hidden.device)  # [N, 2]
        cos, sin = rotary_cos_sin(coords, self.head_dim, self.rope_theta)
        cu_seqlens = frame_cu_seqlens(grids)
        deepstack = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, cu_seqlens)
            if index in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(hidden))
        return self.merger(hidden), deepstack

    def activation_bytes(self, num_patches: int) -> int:
        """An upper estimate of the forward's peak activation memory for one image of
        `num_patches` patches, for the memory plan: the fp32 pixels, the fp32 position-table
        taps [N, 4, E], the rotary tables, and inside the widest block the residual, normed,
        qkv, rotated q/k, attention and MLP tensors (attention itself is flash-style, linear in
        N), plus the merged outputs (DeepStack's included)."""
        config = self.config
        itemsize = self.pos_embed.weight.dtype.itemsize
        hidden, inner = config.hidden_size, config.intermediate_size
        fp32 = 4 * (self.patch_dim + 4 * hidden + 2 * self.head_dim)
        block = itemsize * (9 * hidden + 2 * inner)
        num_merged = 1 + len(self.deepstack_visual_indexes)
        merged = itemsize * num_merged * (2 * hidden + config.out_hidden_size)
        return num_patches * (fp32 + block + merged)

    def interpolated_positions(self, grids: list[list[int]]) -> torch.Tensor:
        """The learned table resampled to each image's patch grid, in patch order; [N, E] fp32."""
        indices, weights = position_table_taps(grids, self.table_side, self.spatial_merge_size)
        table = self.pos_embed.weight
        rows = table[indices.to(table.device)].float()  # [N, 4, E]
        return (rows * weights.to(table.device)[:, :, None]).sum(dim=1)

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw) -> list[list[int]]:
        """`grid_thw` as lists; ValueError naming the mismatch when the inputs disagree."""
        if torch.is_tensor(grid_thw):
            grid_thw = grid_thw.tolist()
        grids = [[int(x) for x in grid] for grid in grid_thw]
        merge = self.spatial_merge_size
        if any(len(grid) != 3 or min(grid) < 1 for grid in grids):
            raise ValueError(f"grid_thw must be positive (t, h, w) triples, got {grids}")
        if any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"grid_thw {grids}: h and w must be multiples of {merge}")
        num_patches = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (num_patches, self.patch_dim):
            raise ValueError(
                f"pixel_values shape {tuple(pixel_values.shape)} != ({num_patches}, "
                f"{self.patch_dim}) expected from grid_thw {grids}"
            )
        return grids

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tower weights, named relative to the tower (`blocks.0.attn.qkv.weight`), into
        the parameters. Raises ValueError naming missing or unexpected weights."""
        route_weights(self, weights)
