"""Image inputs: decoding untrusted bytes (`image`), fetching them under the operator's policy
(`fetch`) and the Qwen vision preprocessing (`processor`). Runs in the HTTP process, off the
event loop; the engine only ever sees `ProcessedImage` tensors."""

from axon.multimodal.fetch import MediaPolicy, fetch_bytes, fetch_image
from axon.multimodal.image import (
    DecodedImage,
    InvalidImage,
    decode_data_uri,
    decode_image,
    parse_data_uri,
)
from axon.multimodal.processor import ImageProcessor, ProcessedImage, ProcessorConfig

__all__ = [
    "DecodedImage",
    "ImageProcessor",
    "InvalidImage",
    "MediaPolicy",
    "ProcessedImage",
    "ProcessorConfig",
    "decode_data_uri",
    "decode_image",
    "fetch_bytes",
    "fetch_image",
    "parse_data_uri",
]
