"""Decoding untrusted image bytes: `data:` URIs, format sniffing, size caps, EXIF, RGB.

Everything here runs in the HTTP process on bytes a client chose, so every failure is one typed
error, `InvalidImage`, whose `reason` is a short slug and whose message says what was wrong; the
server maps it to a 400 `invalid_image`. Nothing here touches the network or the filesystem.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.parse
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

# A data URI or a download beyond this is refused before any decoding.
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
# Decoded pixels (width x height) beyond this are refused from the header, before the pixel
# data is decompressed: a 100 KB PNG can claim 50,000 x 50,000 pixels (a decompression bomb).
DEFAULT_MAX_DECODED_PIXELS = 1 << 25

# Magic numbers -> the Pillow plugin allowed to open the bytes. The client's MIME type is never
# trusted: only these five decoders ever see untrusted bytes.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)


class InvalidImage(ValueError):
    """An image input that cannot be used. `reason` is a slug (`bad_data_uri`, `bad_base64`,
    `unknown_format`, `too_large`, `too_many_pixels`, `bad_aspect_ratio`, `corrupt`,
    `forbidden_url`, `fetch_failed`); the message names it and says what was wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"invalid image ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # mode "RGB", EXIF orientation applied
    format: str  # the sniffed format: PNG, JPEG, GIF, WEBP or BMP
    num_bytes: int  # size of the encoded input
    sha256: str  # hex digest of the encoded bytes: prefix-cache identity of the image


def sniff_format(data: bytes) -> str:
    """The format named by `data`'s magic number; raises InvalidImage(unknown_format)."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    raise InvalidImage(
        "unknown_format", "the bytes are not a PNG, JPEG, WebP, GIF or BMP image (magic number)"
    )


def parse_data_uri(uri: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The payload of `data:[<mediatype>][;base64],<data>` (RFC 2397). Base64 is strict: no
    whitespace, no characters outside the alphabet, correct padding. The media type is ignored
    (the format is sniffed later). Raises InvalidImage."""
    if not uri[:5].lower() == "data:":
        raise InvalidImage("bad_data_uri", "a data URI must start with 'data:'")
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise InvalidImage("bad_data_uri", "a data URI needs a ',' before its payload")
    if header.lower().endswith(";base64"):
        # Checked before decoding so an oversized URI costs no allocation: 4 chars -> 3 bytes.
        if len(payload) > 4 * (max_bytes // 3 + 1):
            raise _too_large(max_bytes)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise InvalidImage("bad_base64", f"the base64 payload is malformed ({error})") from None
    else:
        if len(payload) > 3 * max_bytes:  # '%41' is the longest spelling of one byte
            raise _too_large(max_bytes)
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    if not data:
        raise InvalidImage("bad_data_uri", "the data URI has an empty payload")
    return data


def decode_image(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> DecodedImage:
    """Decodes `data` (PNG, JPEG, WebP, GIF's first frame, BMP; sniffed) into an RGB image with
    its EXIF orientation applied and any transparency composited on white, as transformers'
    image processors do. Raises InvalidImage; never decodes more than `max_pixels` pixels."""
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    image_format = sniff_format(data)
    image = _open_checked(data, image_format, max_pixels)
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        rgb = to_rgb(image)
    except InvalidImage:
        raise
    except Exception as error:  # Pillow raises OSError, SyntaxError, struct.error, ...
        raise InvalidImage("corrupt", f"the {image_format} data is truncated or corrupt") from error
    digest = hashlib.sha256(data).hexdigest()
    return DecodedImage(image=rgb, format=image_format, num_bytes=len(data), sha256=digest)


def decode_data_uri(
    uri: str,
    *,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> DecodedImage:
    """parse_data_uri + decode_image."""
    data = parse_data_uri(uri, max_bytes)
    return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in mode RGB. Transparency (an alpha band, or a palette / tRNS transparent colour)
    is composited on opaque white: the same code as transformers' `image_transforms.
    convert_to_rgb`, so a reference processor given the raw image sees the same pixels."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _open_checked(data: bytes, image_format: str, max_pixels: int) -> Image.Image:
    """Opens `data` with only the sniffed decoder and reads the header, refusing more than
    `max_pixels` before any pixel data is decompressed."""
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns at its global limit; ours, below, is the one that
            # counts (and it is the stricter one by default).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[image_format])
    except Image.DecompressionBombError:
        raise _too_many_pixels(None, max_pixels) from None
    except Exception as error:
        raise InvalidImage("corrupt", f"the {image_format} header is truncated or corrupt") from (
            error
        )
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidImage("corrupt", f"the {image_format} image has size {width}x{height}")
    if width * height > max_pixels:
        raise _too_many_pixels((width, height), max_pixels)
    return image


def _too_large(max_bytes: int) -> InvalidImage:
    return InvalidImage("too_large", f"the encoded image exceeds the limit of {max_bytes} bytes")


def _too_many_pixels(size: tuple[int, int] | None, max_pixels: int) -> InvalidImage:
    shown = f"{size[0]}x{size[1]} pixels" if size else "too many pixels"
    return InvalidImage("too_many_pixels", f"{shown} exceeds the limit of {max_pixels} pixels")
