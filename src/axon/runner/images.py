"""A runner's image work that needs no runner state: a request's image inputs checked against
its prompt (M-RoPE positions, content hashes), which scheduled chunks hold image tokens and
which tower rows each takes, and the memory the tower needs on the largest allowed image."""

from __future__ import annotations

import hashlib

import torch

from axon.batch import SchedulerOutput
from axon.config import EngineConfig
from axon.models.mrope import mrope_positions
from axon.multimodal.placeholders import image_spans
from axon.multimodal.processor import ProcessorConfig
from axon.sequence import ImageInputs, Sequence


def image_inputs(model, token_ids: list[int], pixel_values, grid_thw) -> ImageInputs:
    """A request's images checked against its (expanded) prompt, with their M-RoPE positions
    and content hashes. Raises ValueError without a tower or on a mismatch."""
    if getattr(model, "visual", None) is None:
        raise ValueError("this model has no vision tower loaded: images are not supported")
    grids = grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw
    grids = [tuple(int(x) for x in grid) for grid in grids]
    pixel_values = torch.as_tensor(pixel_values, dtype=torch.float32).cpu()
    model.visual.check_inputs(pixel_values, grids)
    ids = (model.spatial_merge_size, model.image_token_id, model.vision_start_token_id)
    positions, delta = mrope_positions(token_ids, grids, *ids)
    hashes, first = [], 0
    for t, h, w in grids:
        patches = pixel_values[first : first + t * h * w]
        first += t * h * w
        digest = hashlib.sha256(repr((t, h, w)).encode())
        digest.update(patches.numpy().tobytes())
        hashes.append(digest.digest())
    spans = image_spans(token_ids, grids, *ids)
    return ImageInputs(pixel_values, grids, spans, hashes, positions, delta)


def image_chunks(out: SchedulerOutput) -> list[tuple[Sequence, int, int, int]]:
    """(seq, batch row, start, end) of each scheduled chunk with image-prompt tokens."""
    chunks, row = [], 0
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        if seq.images is not None and start < seq.num_prompt_tokens:
            chunks.append((seq, row, start, start + num_new))
        row += num_new
    return chunks


def image_slices(images: ImageInputs, row: int, start: int, end: int) -> list:
    """(batch rows [n], slice of the tower's output) per image that the chunk of prompt
    tokens [start, end) at batch row `row` covers; a chunk may cut through an image."""
    slices, offset = [], 0
    for first, count in images.spans:
        low, high = max(first, start), min(first + count, end)
        if low < high:
            taken = slice(offset + low - first, offset + high - first)
            slices.append((torch.arange(low, high) + (row - start), taken))
        offset += count
    return slices


def vision_reserve(model, config: EngineConfig) -> int:
    """The vision tower's peak activations on the largest image the engine's limits allow
    (0 without a tower): memory the KV cache leaves free."""
    visual = getattr(model, "visual", None)
    if visual is None:
        return 0
    try:
        processor = ProcessorConfig.for_engine(
            config.model, config.max_image_pixels, config.image_profile
        )
    except FileNotFoundError:
        return 0  # no preprocessor: the server takes no images for this model
    return visual.activation_bytes(processor.max_patches)


def add_images(batch, out: SchedulerOutput, encode_images, keep_takes: bool) -> None:
    """When a chunk covers image-prompt tokens: give `batch` (a StepBatch) M-RoPE positions
    [3, T] and those chunks' image rows and DeepStack features (the tower runs once per
    request, `encode_images(pixels, grids, True)`); `keep_takes` (tensor parallelism) records
    which tower rows each part took. Else leaves it as it is."""
    chunks = image_chunks(out)
    if not chunks:
        return  # text and decodes only: 1-D positions, the fast path
    device = batch.positions.device
    positions = batch.positions.expand(3, -1).clone()  # text rows: three equal rows
    rows, values, deepstack, takes = [], [], [], []
    for seq, row, start, end in chunks:
        inputs = seq.images
        prompt_end = min(end, seq.num_prompt_tokens)
        prompt_positions = inputs.positions[:, start:prompt_end]
        positions[:, row : row + prompt_end - start] = prompt_positions.to(device)
        for image_rows, taken in image_slices(inputs, row, start, end):
            if inputs.embeds is None:
                pixels, grids = inputs.pixel_values, inputs.grid_thw
                inputs.embeds, inputs.deepstack = encode_images(pixels, grids, True)
            rows.append(image_rows)
            values.append(inputs.embeds[taken])
            takes.append((inputs, taken))
            if inputs.deepstack is not None:
                deepstack.append(inputs.deepstack[:, taken])
    batch.positions = positions
    if rows:
        batch.image_rows = torch.cat(rows).to(device)
        batch.image_values = torch.cat(values)
        batch.image_deepstack = torch.cat(deepstack, dim=1) if deepstack else None
        batch.image_takes = takes if keep_takes else None
