"""M-RoPE position ids (Qwen3.5, Qwen3-VL): three rows (t, h, w) per token.

Text tokens advance all three rows together. An image's placeholder tokens
(`<|vision_start|>` then `<|image_pad|>` x t*h*w/merge^2) are laid out on the image's merged grid,
every row offset by the position the image starts at; the text after an image resumes at the
image's largest position + 1. Past the prompt every row is `index + mrope_position_delta`, the
delta being the prompt's largest position + 1 - its length. Computed once per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from axon.multimodal.placeholders import image_spans


def grid_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    """Positions of a (t, h, w) merged grid in row-major order, offset by `start`; [3, t*h*w]."""
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def mrope_text_positions(first_index: int, num_tokens: int, delta: int) -> torch.Tensor:
    """Positions of tokens `first_index ..` past the images (decode, generated text); [3, n]."""
    return torch.arange(first_index, first_index + num_tokens).expand(3, -1) + delta


def mrope_positions(
    token_ids: Sequence[int],
    image_grids: Sequence[Sequence[int]],
    spatial_merge_size: int,
    image_token_id: int,
    vision_start_token_id: int,
) -> tuple[torch.Tensor, int]:
    """(positions [3, len(token_ids)] int64 with rows t, h, w; mrope_position_delta) of a prompt
    whose images have patch grids `image_grids` (t, h, w), in prompt order. Pure; raises
    ValueError when the image placeholders do not match the grids."""
    token_ids = list(token_ids)
    spans = image_spans(
        token_ids, image_grids, spatial_merge_size, image_token_id, vision_start_token_id
    )
    pieces, next_position, cursor = [], 0, 0
    for (start, count), (t, h, w) in zip(spans, image_grids):
        pieces.append(mrope_text_positions(next_position, start - cursor, 0))
        next_position += start - cursor
        merged = grid_positions(next_position, t, h // spatial_merge_size, w // spatial_merge_size)
        pieces.append(merged)
        next_position, cursor = int(merged.max()) + 1, start + count
    pieces.append(mrope_text_positions(next_position, len(token_ids) - cursor, 0))
    positions = torch.cat(pieces, dim=1)  # [3, T]
    delta = int(positions.max()) + 1 - len(token_ids) if token_ids else 0
    return positions, delta
