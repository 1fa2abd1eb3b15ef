"""Image placeholder tokens in a prompt: expanding each image's one placeholder to its token
count, and finding each image's span. Pure Python (no torch), so the HTTP process checks prompts
with the same code the runner lays M-RoPE positions out with (models/mrope.py)."""

from __future__ import annotations

from collections.abc import Sequence


def image_spans(
    token_ids: Sequence[int],
    image_grids: Sequence[Sequence[int]],
    spatial_merge_size: int,
    image_token_id: int,
    vision_start_token_id: int,
) -> list[tuple[int, int]]:
    """(first placeholder index, placeholder count) of each image, in prompt order. Raises
    ValueError when the placeholders and the grids disagree (count, position, or stray pads)."""
    starts = [
        index + 1
        for index in range(len(token_ids) - 1)
        if token_ids[index] == vision_start_token_id and token_ids[index + 1] == image_token_id
    ]
    if len(starts) != len(image_grids):
        raise ValueError(f"prompt has {len(starts)} images but {len(image_grids)} image grids")
    spans = []
    for number, (start, (t, h, w)) in enumerate(zip(starts, image_grids)):
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"image {number} grid {(t, h, w)} is not a multiple of the merge size")
        count = t * h * w // spatial_merge_size**2
        end = start + count
        exact = token_ids[start:end] == [image_token_id] * count
        if not exact or (end < len(token_ids) and token_ids[end] == image_token_id):
            raise ValueError(f"image {number} needs exactly {count} image tokens in the prompt")
        spans.append((start, count))
    total = sum(count for _, count in spans)
    if sum(tok == image_token_id for tok in token_ids) != total:
        raise ValueError(f"prompt has image tokens outside its {len(spans)} images")
    return spans


def expand_image_placeholders(
    token_ids: list[int], counts: list[int], image_token_id: int
) -> list[int]:
    """`token_ids` with the i-th image placeholder token repeated `counts[i]` times. Raises
    ValueError when the number of placeholders is not the number of images."""
    places = [index for index, token in enumerate(token_ids) if token == image_token_id]
    if len(places) != len(counts):
        raise ValueError(
            f"prompt has {len(places)} image placeholders (<|image_pad|>, token id "
            f"{image_token_id}) but {len(counts)} images"
        )
    expanded, cursor = [], 0
    for place, count in zip(places, counts):
        expanded += token_ids[cursor:place] + [image_token_id] * count
        cursor = place + 1
    return expanded + token_ids[cursor:]
