"""Qwen2-VL / Qwen3-VL / Qwen3.5 image preprocessing, identical to transformers' PIL backend.

`ImageProcessor` reproduces `Qwen2VLImageProcessorPil` (transformers 5.x,
`models/qwen2_vl/image_processing_pil_qwen2_vl.py`) step for step, so the pixels are the same
bit for bit: smart resize into the checkpoint's pixel band with Pillow's filter on the uint8 RGB
image, rescale in float64 then float32, normalize in float32, then the patch layout
`[grid_h * grid_w, C * temporal_patch * patch * patch]` the vision tower's Conv3d reads.

The server's limits never add a step of their own: a cap on pixels per image narrows the band
(`longest_edge`), and neuron's fixed 448x448 profile is a resize to 448x448 before the same
pipeline (448 is a multiple of the grid factor, so smart resize keeps it), so a reference
processor given the same band (`reference_kwargs`) and the same input agrees exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from axon.multimodal.image import InvalidImage

# transformers' defaults for a preprocessor_config.json that leaves a field out
# (Qwen2VLImageProcessorPil's class attributes; OPENAI_CLIP_MEAN / _STD).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MAX_ASPECT_RATIO = 200
NEURON_FIXED_SIDE = 448  # neuron's fa013505-era profile: every image 448x448


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [grid_h * grid_w, 3 * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    num_tokens: int  # LM placeholder tokens: grid_t * grid_h * grid_w // merge_size**2


@dataclass(frozen=True)
class ProcessorConfig:
    """The fields of preprocessor_config.json the Qwen processors read, with transformers'
    defaults. `min_pixels` / `max_pixels` are the smart-resize band (`size.shortest_edge` /
    `size.longest_edge`); `fixed_side`, when set, resizes every image to that square first."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    fixed_side: int | None = None

    def __post_init__(self) -> None:
        factor = self.factor
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"preprocessor: {name} must be >= 1, got {getattr(self, name)}")
        if not factor * factor <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"preprocessor: the pixel band must satisfy factor^2 <= min_pixels <= max_pixels"
                f" (factor {factor}), got [{self.min_pixels}, {self.max_pixels}]"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("preprocessor: image_mean and image_std need 3 values")
        side = self.fixed_side
        if side is not None and side % factor:
            raise ValueError(f"preprocessor: fixed_side {side} must be a multiple of {factor}")
        if side is not None and not self.min_pixels <= side * side <= self.max_pixels:
            raise ValueError(f"preprocessor: fixed_side {side}^2 must lie in the pixel band")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged patch."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProcessorConfig:
        """From the JSON of preprocessor_config.json. Top-level `min_pixels` / `max_pixels`
        (Qwen2-VL era) override `size`, as in transformers' constructor."""
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise ValueError(f"preprocessor: size must be an object, got {size!r}")
        min_pixels = raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        max_pixels = raw.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        if raw.get("do_resize", True) is False:
            raise ValueError("preprocessor: do_resize false is not supported (sides must fit)")
        fields: dict[str, Any] = {"min_pixels": int(min_pixels), "max_pixels": int(max_pixels)}
        for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if raw.get(name) is not None:
                fields[name] = int(raw[name])
        for name in ("image_mean", "image_std"):
            if raw.get(name) is not None:
                value = raw[name]
                fields[name] = tuple(
                    float(v) for v in (value if isinstance(value, list) else [value] * 3)
                )
        if raw.get("rescale_factor") is not None:
            fields["rescale_factor"] = float(raw["rescale_factor"])
        for name in ("do_rescale", "do_normalize"):
            if raw.get(name) is not None:
                fields[name] = bool(raw[name])
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> ProcessorConfig:
        """From a preprocessor_config.json file (or the checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "preprocessor_config.json"
        return cls.from_dict(json.loads(path.read_text()))

    def with_limits(
        self, max_image_pixels: int | None = None, fixed_side: int | None = None
    ) -> ProcessorConfig:
        """This config under the server's limits: `max_image_pixels` lowers the top of the band
        (the bottom follows when it would cross), and `fixed_side` selects the fixed-square
        profile (neuron's is NEURON_FIXED_SIDE). Raises ValueError for a cap below factor^2."""
        max_pixels = self.max_pixels
        if max_image_pixels is not None:
            max_pixels = min(max_pixels, max_image_pixels)
        return replace(
            self,
            min_pixels=min(self.min_pixels, max_pixels),
            max_pixels=max_pixels,
            fixed_side=fixed_side if fixed_side is not None else self.fixed_side,
        )

    @classmethod
    def for_engine(
        cls, model_dir: str | Path, max_image_pixels: int | None, image_profile: str
    ) -> ProcessorConfig:
        """A checkpoint's preprocessor_config.json under an engine's limits (EngineConfig's
        `max_image_pixels` and `image_profile`): what the server preprocesses with and the
        memory plan reserves for. Raises FileNotFoundError without the file."""
        fixed_side = NEURON_FIXED_SIDE if image_profile == "fixed448" else None
        return cls.from_file(model_dir).with_limits(max_image_pixels, fixed_side)

    @property
    def max_patches(self) -> int:
        """Patches of the largest image this config lets through (smart resize never goes
        above the band's top; the fixed profile resizes every image to one size)."""
        if self.fixed_side is not None:
            side = self.fixed_side
            height, width = smart_resize(side, side, self.factor, self.min_pixels, self.max_pixels)
            return height * width // self.patch_size**2
        return self.max_pixels // self.patch_size**2

    def reference_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that make transformers' Qwen2VLImageProcessorPil behave as this
        config (the pixel band included); for tests and for checking a deployment."""
        return {
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "resample": self.resample,
            "rescale_factor": self.rescale_factor,
            "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize,
        }


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """(height, width) rounded to multiples of `factor` with the area inside [min, max] and the
    aspect ratio kept: transformers' `smart_resize`, operation for operation. Raises
    InvalidImage(bad_aspect_ratio) beyond 200:1."""
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise InvalidImage(
            "bad_aspect_ratio",
            f"{width}x{height} has an aspect ratio over {_MAX_ASPECT_RATIO}:1",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class ImageProcessor:
    """Turns an RGB image into the tower's input. Stateless after construction; safe to share
    between threads (Pillow and numpy release no shared state here)."""

    def __init__(self, config: ProcessorConfig):
        self.config = config
        dtype = np.float32
        self._mean = np.asarray(config.image_mean, dtype=dtype)[:, None, None]  # [3, 1, 1]
        self._std = np.asarray(config.image_std, dtype=dtype)[:, None, None]  # [3, 1, 1]

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to, without touching pixels."""
        config = self.config
        if config.fixed_side is not None:
            height = width = config.fixed_side
        return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """LM placeholder tokens for an image of this size (what `<|image_pad|>` expands to)."""
        resized_height, resized_width = self.resized_size(height, width)
        patch = self.config.patch_size
        grid = (resized_height // patch) * (resized_width // patch)
        return grid // self.config.merge_size**2

    def __call__(self, image: Image.Image) -> ProcessedImage:
        """`image` (mode RGB) resized, rescaled, normalized and cut into patches."""
        if image.mode != "RGB":
            raise ValueError(f"ImageProcessor needs an RGB image, got mode {image.mode}")
        config = self.config
        if config.fixed_side is not None:
            side = config.fixed_side
            image = image.resize((side, side), resample=config.resample)
        height, width = self.resized_size(image.height, image.width)
        resized = image.resize((width, height), resample=config.resample)
        pixels = np.moveaxis(np.asarray(resized), -1, 0)  # [3, H, W] uint8
        pixels = self._normalize(pixels)
        patches, grid_h, grid_w = self._patchify(pixels)
        grid_thw = (1, grid_h, grid_w)
        num_tokens = grid_h * grid_w // config.merge_size**2
        return ProcessedImage(pixel_values=patches, grid_thw=grid_thw, num_tokens=num_tokens)

    def _normalize(self, pixels: np.ndarray) -> np.ndarray:
        """transformers' rescale (float64 product, then float32) and normalize (float32)."""
        if self.config.do_rescale:
            pixels = (pixels.astype(np.float64) * self.config.rescale_factor).astype(np.float32)
        if self.config.do_normalize:
            if not np.issubdtype(pixels.dtype, np.floating):
                pixels = pixels.astype(np.float32)
            pixels = (pixels - self._mean) / self._std
        return np.asarray(pixels, dtype=np.float32)

    def _patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, int, int]:
        """[3, H, W] -> [grid_h * grid_w, 3 * T * P * P], patches ordered merge-window by
        merge-window (the 2x2 merger's neighbours adjacent), each frame repeated T times."""
        config = self.config
        patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
        channels, height, width = pixels.shape
        grid_h, grid_w = height // patch, width // patch
        patches = pixels.reshape(
            channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        )
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        patches = np.broadcast_to(
            patches[:, :, :, :, :, None], (*patches.shape[:5], temporal, patch, patch)
        )
        flat = patches.reshape(grid_h * grid_w, channels * temporal * patch * patch)
        return np.ascontiguousarray(flat), grid_h, grid_w
