"""Image parts of a request, made into the engine's image inputs in the HTTP process.

A chat's `image_url` parts are fetched (`data:` URIs; http(s) and file:// only as the media
policy allows), decoded and preprocessed here, on the request pool and never in the engine, in
the order the chat template meets them. The rendered prompt's `<|image_pad|>` placeholders are
then expanded to each image's token count; the engine receives the expanded ids with the pixel
patches and grids. Every failure is a 400 before the engine sees the request: `invalid_image`
(naming the reason) for an image that cannot be used, `vision_unsupported` without a tower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from axon.multimodal.fetch import MediaPolicy, fetch_image
from axon.multimodal.image import InvalidImage
from axon.multimodal.placeholders import expand_image_placeholders, image_spans
from axon.multimodal.processor import (
    ImageProcessor,
    ProcessedImage,
    ProcessorConfig,
)
from axon.server.errors import BadRequest

logger = logging.getLogger(__name__)

IMAGE_PART_TYPES = ("image_url", "image")  # chat's image part, and HF's
DETAILS = ("auto", "low", "high")
# OpenAI's "low" detail: the image at most 512x512 pixels, whatever the server's band allows.
LOW_DETAIL_PIXELS = 512 * 512


@dataclass(frozen=True)
class ImagePart:
    url: str
    detail: str
    param: str  # the request field it came from, for error messages


@dataclass
class RequestImages:
    """A request's preprocessed images, in prompt order."""

    images: list[ProcessedImage]

    def engine_inputs(self) -> dict:
        return {
            "pixel_values": np.concatenate([image.pixel_values for image in self.images]),
            "grid_thw": [image.grid_thw for image in self.images],
        }


def invalid_image(error: InvalidImage, param: str) -> BadRequest:
    return BadRequest(f"{param}: {error}", code="invalid_image", param=param)


def image_parts(messages: list[dict], field: str = "messages") -> list[ImagePart]:
    """The image parts of chat `messages` in order (the order the template emits their
    placeholders in). Raises BadRequest for a malformed part."""
    parts = []
    for number, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for index, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                parts.append(_image_part(part, f"{field}[{number}].content[{index}]"))
    return parts


def _image_part(part: dict, param: str) -> ImagePart:
    """An `image_url` part: `{"image_url": "URL"}` or `{"image_url": {"url", "detail"}}` (HF's
    `{"type": "image", "url"}` too)."""
    value = part.get("image_url") if part.get("type") == "image_url" else part
    if isinstance(value, str):
        return ImagePart(value, "auto", param)
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise BadRequest(
            f"{param}.image_url must be a URL string or an object with a url",
            param=f"{param}.image_url",
        )
    detail = value.get("detail") or "auto"
    if detail not in DETAILS:
        raise BadRequest(
            f"{param}.image_url.detail must be one of {', '.join(DETAILS)}, got {detail!r}",
            param=f"{param}.image_url.detail",
        )
    return ImagePart(value["url"], detail, param)


class ImageFrontend:
    """One served model's image side: the checkpoint's preprocessor under the server's limits,
    the media policy, and the ids of the image placeholder tokens."""

    def __init__(self, processor: ProcessorConfig, policy: MediaPolicy, info: dict):
        self.processor = ImageProcessor(processor)
        low = processor.with_limits(max_image_pixels=LOW_DETAIL_PIXELS)
        self.low_detail = ImageProcessor(low)
        self.policy = policy
        self.max_images = int(info["max_images_per_prompt"])
        self.image_token_id = int(info["image_token_id"])
        self.vision_start_token_id = int(info["vision_start_token_id"])
        self.merge_size = int(info["spatial_merge_size"])

    @classmethod
    def of(cls, model_path: str, info: dict | None, policy: MediaPolicy) -> ImageFrontend | None:
        """The frontend of a model whose engine loaded a vision tower (`info`: the engine's
        `vision` info), else None. The processor is the checkpoint's preprocessor_config.json
        with the engine's pixel cap and profile, exactly as the engine planned memory for."""
        if not info:
            return None
        try:
            config = ProcessorConfig.for_engine(
                model_path, info.get("max_image_pixels"), info.get("image_profile") or "native"
            )
        except FileNotFoundError:
            logger.warning("%s has a vision tower but no preprocessor_config.json", model_path)
            return None
        return cls(config, policy, info)

    def load(self, parts: list[ImagePart]) -> RequestImages:
        """Fetch, decode and preprocess every part. Blocking (network, decoding): run it off
        the event loop. Raises BadRequest(invalid_image) naming the part and the reason."""
        if len(parts) > self.max_images:
            raise BadRequest(
                f"{parts[self.max_images].param}: at most {self.max_images} images per request "
                "(limit_mm_per_prompt)",
                code="invalid_image",
                param=parts[self.max_images].param,
            )
        images = []
        for part in parts:
            processor = self.low_detail if part.detail == "low" else self.processor
            try:
                decoded = fetch_image(part.url, self.policy)
                images.append(processor(decoded.image))
            except InvalidImage as error:
                raise invalid_image(error, part.param) from None
        return RequestImages(images)

    def expand(self, token_ids: list[int], images: RequestImages, param: str) -> list[int]:
        """`token_ids` with each image's `<|image_pad|>` repeated to its token count, checked
        the way the engine lays images out. Raises BadRequest when the rendered prompt's
        placeholders do not match the images (a template that drops image parts, or a text
        that spells the placeholder tokens itself)."""
        counts = [image.num_tokens for image in images.images]
        try:
            expanded = expand_image_placeholders(token_ids, counts, self.image_token_id)
        except ValueError:
            raise BadRequest(
                f"the chat template rendered a different number of image placeholders than the "
                f"{len(counts)} images; this model's template cannot place them",
                code="invalid_image",
                param=param,
            ) from None
        grids = [image.grid_thw for image in images.images]
        try:
            image_spans(
                expanded, grids, self.merge_size, self.image_token_id, self.vision_start_token_id
            )
        except ValueError as error:
            message = f"image placeholders: {error}"
            raise BadRequest(message, code="invalid_image", param=param) from None
        return expanded


def checked_image_parts(model, messages: list[dict], field: str) -> list[ImagePart]:
    """The image parts of `messages`, checked before any work is done for them: a model
    without a vision tower (`model.images` None) answers BadRequest(vision_unsupported)."""
    parts = image_parts(messages, field)
    if parts and model.images is None:
        param = parts[0].param
        raise BadRequest(
            f"{param}: this model has no vision encoder; image inputs are not supported",
            code="vision_unsupported",
            param=param,
        )
    return parts


def with_images(
    model, parts: list[ImagePart], prompt_ids: list[int], field: str
) -> tuple[list[int], dict | None]:
    """(the prompt ids with their image placeholders expanded, the engine's image inputs) for
    the checked `parts`; (prompt_ids, None) without images. Fetches and decodes: blocking."""
    if not parts:
        return prompt_ids, None
    images = model.images.load(parts)
    return model.images.expand(prompt_ids, images, field), images.engine_inputs()


def media_policy(server_config: Any) -> MediaPolicy:
    """The server config's media policy (defaults: data: URIs only)."""
    if server_config is None:
        return MediaPolicy()
    return MediaPolicy(
        allowed_domains=tuple(server_config.allowed_media_domains),
        allowed_local_media_path=server_config.allowed_local_media_path,
        max_bytes=server_config.max_image_bytes,
        timeout_s=server_config.media_fetch_timeout_s,
        allow_private_addresses=server_config.allow_private_media_addresses,
    )
