"""axon.multimodal: image decoding, URL fetching under a MediaPolicy, and Qwen preprocessing
compared bit for bit with transformers' Qwen2VLImageProcessorPil. Images are generated here;
the only server contacted is a loopback one the test runs."""

from __future__ import annotations

import base64
import io
import ipaddress
import json
import os
import struct
import threading
import time
import urllib.parse
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image, ImageOps, features

from axon.multimodal.fetch import MediaPolicy, fetch_bytes, fetch_image, is_forbidden_address
from axon.multimodal.image import InvalidImage, decode_data_uri, decode_image, parse_data_uri
from axon.multimodal.processor import (
    NEURON_FIXED_SIDE,
    ImageProcessor,
    ProcessorConfig,
)

pil_processor = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

# Qwen3-VL / Qwen3.5 layout (patch 16, mean/std 0.5) with a pixel band that is NOT Qwen's
# default (65,536 .. 16,777,216): small images are scaled up and large ones down.
QWEN3_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 12_288, "longest_edge": 150_000},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
}
# Qwen2-VL era: patch 14, CLIP mean/std from the class defaults, top-level min/max_pixels.
QWEN2_CONFIG = {"min_pixels": 3136 * 2, "max_pixels": 80_000, "patch_size": 14, "resample": 2}


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode)


def encode(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def exif_jpeg() -> bytes:
    """40x20 stored, left half red; orientation 6 says 'rotate 90 degrees clockwise to show'."""
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(image, "JPEG", exif=exif.tobytes(), quality=95)


def palette_png_with_alpha() -> bytes:
    """Palette PNG: index 0 transparent (shows as white after compositing), index 1 green."""
    image = Image.new("P", (64, 48), 0)
    image.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    image.paste(1, (0, 0, 32, 48))
    return encode(image, "PNG", transparency=0)


def two_frame_gif() -> bytes:
    frames = [Image.new("RGB", (30, 30), color) for color in ((255, 0, 0), (0, 0, 255))]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)


def png_header_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height: a decompression bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# --- decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "BMP", "GIF", "WEBP"])
def test_decode_each_format_is_sniffed(image_format):
    if image_format == "WEBP" and not features.check("webp"):
        pytest.skip("Pillow built without WebP")
    data = encode(noise(37, 21), image_format)
    # The MIME type lies on purpose: the bytes decide.
    decoded = decode_data_uri(data_uri(data, mime="image/x-anything"))
    assert decoded.format == image_format
    assert decoded.image.mode == "RGB" and decoded.image.size == (37, 21)
    assert decoded.num_bytes == len(data)


def test_lossless_decode_keeps_pixels():
    image = noise(50, 30)
    for image_format in ("PNG", "BMP"):
        decoded = decode_image(encode(image, image_format))
        assert np.array_equal(np.asarray(decoded.image), np.asarray(image))


def test_gif_first_frame():
    decoded = decode_image(two_frame_gif())
    assert decoded.format == "GIF"
    assert decoded.image.getpixel((15, 15)) == (255, 0, 0)


def test_exif_orientation_applied():
    decoded = decode_image(exif_jpeg())
    assert decoded.image.size == (20, 40)  # rotated: portrait now
    top, bottom = decoded.image.getpixel((10, 5)), decoded.image.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60  # the stored left (red) half is on top
    assert bottom[2] > 200 and bottom[0] < 60


def test_palette_alpha_composited_on_white():
    decoded = decode_image(palette_png_with_alpha())
    assert decoded.image.getpixel((10, 10)) == (0, 200, 0)
    assert decoded.image.getpixel((50, 10)) == (255, 255, 255)


def test_rgba_half_transparent_composited_on_white():
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 128))
    assert decode_image(encode(rgba, "PNG")).image.getpixel((0, 0)) == (127, 127, 127)


def test_same_bytes_same_digest_different_bytes_differ():
    one, other = encode(noise(8, 8, seed=1), "PNG"), encode(noise(8, 8, seed=2), "PNG")
    assert decode_image(one).sha256 == decode_image(bytes(one)).sha256
    assert decode_image(one).sha256 != decode_image(other).sha256


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "unknown_format"),
        (b"garbage, not an image at all", "unknown_format"),
        (b"%PDF-1.7 not an image", "unknown_format"),
        (b"\x89PNG\r\n\x1a\n", "corrupt"),
        (b"\xff\xd8\xff\xe0" + b"\x00" * 40, "corrupt"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 garbage", "corrupt"),
    ],
)
def test_garbage_is_invalid(data, reason):
    with pytest.raises(InvalidImage) as caught:
        decode_image(data)
    assert caught.value.reason == reason
    assert reason in str(caught.value)


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "GIF", "BMP"])
def test_truncated_is_corrupt(image_format):
    data = encode(noise(64, 64), image_format)
    with pytest.raises(InvalidImage) as caught:
        decode_image(data[: len(data) // 2])
    assert caught.value.reason == "corrupt"


def test_decompression_bomb_refused_from_the_header():
    # Beyond Pillow's own hard limit (it raises at open) and below it (our check refuses).
    for width, height in ((100_000, 100_000), (8_000, 8_000)):
        with pytest.raises(InvalidImage) as caught:
            decode_image(png_header_claiming(width, height))
        assert caught.value.reason == "too_many_pixels"
    with pytest.raises(InvalidImage, match="too_many_pixels"):
        decode_image(encode(noise(40, 40), "PNG"), max_pixels=1_000)


def test_encoded_byte_cap():
    data = encode(noise(40, 40), "PNG")
    with pytest.raises(InvalidImage) as caught:
        decode_image(data, max_bytes=len(data) - 1)
    assert caught.value.reason == "too_large"
    with pytest.raises(InvalidImage, match="too_large"):
        parse_data_uri(data_uri(data), max_bytes=len(data) - 1)
    assert parse_data_uri(data_uri(data), max_bytes=len(data)) == data


def test_data_uri_forms():
    data = encode(noise(4, 4), "PNG")
    assert parse_data_uri(data_uri(data)) == data
    assert parse_data_uri("DATA:;base64," + base64.b64encode(data).decode()) == data
    percent = "data:image/png," + urllib.parse.quote_from_bytes(data)
    assert parse_data_uri(percent) == data


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("data:image/png;base64,iVBO!Rw0KGgo=", "bad_base64"),  # outside the alphabet
        ("data:image/png;base64,iVBORw0KGgo", "bad_base64"),  # missing padding
        ("data:image/png;base64,iVBO Rw0K\nGgo=", "bad_base64"),  # whitespace
        ("data:image/png;base64", "bad_data_uri"),  # no comma
        ("data:image/png;base64,", "bad_data_uri"),  # empty
        ("image/png;base64,iVBORw0KGgo=", "bad_data_uri"),
    ],
)
def test_bad_data_uris(uri, reason):
    with pytest.raises(InvalidImage) as caught:
        parse_data_uri(uri)
    assert caught.value.reason == reason


# --- preprocessing vs transformers ---------------------------------------------------------


def images_under_test() -> list[tuple[str, bytes]]:
    """(name, encoded bytes): sizes and aspect ratios around the band, and the hard cases."""
    cases = [
        (f"{width}x{height}", encode(noise(width, height, seed=width), "PNG"))
        for width, height in ((32, 32), (500, 300), (300, 500), (1000, 17), (900, 700), (61, 45))
    ]
    cases.append(("jpeg-exif", exif_jpeg()))
    cases.append(("palette-alpha", palette_png_with_alpha()))
    cases.append(("gif", two_frame_gif()))
    cases.append(("bmp", encode(noise(123, 77, seed=3), "BMP")))
    cases.append(("gray", encode(noise(80, 60, mode="L"), "PNG")))
    cases.append(("rgba", encode(noise(70, 90, mode="RGBA"), "PNG")))
    if features.check("webp"):
        cases.append(("webp", encode(noise(96, 64, seed=4), "WEBP", lossless=True)))
    return cases


def reference_output(reference, raw: bytes, resize_to: int | None = None):
    """transformers' processor on the raw image (its own RGB conversion); EXIF applied first,
    as transformers' load_image does."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(raw)))
    if resize_to is not None:
        image = image.convert("RGB").resize((resize_to, resize_to), Image.Resampling.BICUBIC)
    return reference(images=[image], return_tensors=None)


def assert_same_as_reference(ours, theirs):
    assert ours.pixel_values.dtype == theirs["pixel_values"].dtype == np.float32
    assert np.array_equal(ours.pixel_values, theirs["pixel_values"])
    assert [list(ours.grid_thw)] == theirs["image_grid_thw"].tolist()
    assert ours.num_tokens == int(np.prod(ours.grid_thw)) // 4


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def processors(request, tmp_path_factory):
    """(ours, transformers') built from the same preprocessor_config.json file."""
    raw = QWEN3_CONFIG if request.param == "qwen3" else QWEN2_CONFIG
    directory = tmp_path_factory.mktemp(request.param)
    (directory / "preprocessor_config.json").write_text(json.dumps(raw))
    reference = pil_processor.Qwen2VLImageProcessorPil.from_pretrained(directory)
    return ImageProcessor(ProcessorConfig.from_file(directory)), reference


def test_pixels_and_grid_identical_to_transformers(processors):
    ours, reference = processors
    for name, raw in images_under_test():
        processed = ours(decode_image(raw).image)
        assert_same_as_reference(processed, reference_output(reference, raw)), name
        height, width = decode_image(raw).image.height, decode_image(raw).image.width
        assert ours.num_tokens(height, width) == processed.num_tokens, name


def test_band_is_the_config_not_the_default(processors):
    ours, _ = processors
    small = ours(noise(32, 32))  # scaled up to the band's bottom
    large = ours(noise(900, 700))  # scaled down under its top
    factor = ours.config.factor
    for processed in (small, large):
        pixels = processed.grid_thw[1] * processed.grid_thw[2] * ours.config.patch_size**2
        assert ours.config.min_pixels <= pixels <= ours.config.max_pixels
        assert pixels % (factor * factor) == 0
    assert ours.config.max_pixels < 16_777_216 and ours.config.min_pixels > 56 * 56


def test_server_pixel_cap_narrows_the_band_and_still_matches():
    base = ProcessorConfig.from_dict(QWEN3_CONFIG)
    capped = base.with_limits(max_image_pixels=40_000)
    assert capped.max_pixels == 40_000 and capped.min_pixels == 12_288
    lower = base.with_limits(max_image_pixels=8_192)  # below the band: the bottom follows
    assert lower.min_pixels == lower.max_pixels == 8_192
    reference = pil_processor.Qwen2VLImageProcessorPil(**capped.reference_kwargs())
    raw = encode(noise(900, 700, seed=9), "PNG")
    processed = ImageProcessor(capped)(decode_image(raw).image)
    assert_same_as_reference(processed, reference_output(reference, raw))
    assert processed.num_tokens < ImageProcessor(base)(decode_image(raw).image).num_tokens
    with pytest.raises(ValueError, match="pixel band"):
        base.with_limits(max_image_pixels=512)  # under one merged patch (32 x 32)


def test_neuron_fixed_448_profile():
    config = ProcessorConfig.from_dict(
        {**QWEN3_CONFIG, "size": {"shortest_edge": 65_536, "longest_edge": 589_824}}
    ).with_limits(fixed_side=NEURON_FIXED_SIDE)
    ours = ImageProcessor(config)
    reference = pil_processor.Qwen2VLImageProcessorPil(**config.reference_kwargs())
    for raw in (encode(noise(640, 200, seed=5), "PNG"), exif_jpeg()):
        processed = ours(decode_image(raw).image)
        assert processed.grid_thw == (1, 28, 28) and processed.num_tokens == 196
        assert_same_as_reference(processed, reference_output(reference, raw, resize_to=448))
    assert ours.num_tokens(10, 3000) == 196
    with pytest.raises(ValueError, match="multiple"):
        ProcessorConfig(patch_size=14, fixed_side=448 + 14)


def test_extreme_aspect_ratio_is_invalid_image():
    ours = ImageProcessor(ProcessorConfig.from_dict(QWEN3_CONFIG))
    with pytest.raises(InvalidImage) as caught:
        ours(noise(402, 2))
    assert caught.value.reason == "bad_aspect_ratio"


def test_bad_preprocessor_configs():
    with pytest.raises(ValueError, match="pixel band"):
        ProcessorConfig.from_dict({"size": {"shortest_edge": 9000, "longest_edge": 8000}})
    with pytest.raises(ValueError, match="do_resize"):
        ProcessorConfig.from_dict({**QWEN3_CONFIG, "do_resize": False})


# --- fetching ------------------------------------------------------------------------------

PNG_BYTES = encode(noise(20, 10, seed=7), "PNG")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.seen.append(self.path)
        self.server.hosts.append(self.headers.get("Host"))
        port = self.server.server_address[1]
        routes = {
            "/img.png": (200, {"Content-Length": str(len(PNG_BYTES))}, PNG_BYTES),
            "/big": (200, {"Content-Length": "5000"}, b"\x00" * 5000),
            "/big-undeclared": (200, {}, b"\x00" * 5000),  # ends when the connection closes
            "/same-host": (302, {"Location": "/img.png", "Content-Length": "0"}, b""),
            "/other-host": (302, {"Location": f"http://localhost:{port}/img.png"}, b""),
        }
        if self.path == "/trickle":
            return self._trickle()
        status, headers, body = routes.get(self.path, (404, {"Content-Length": "0"}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self):
        """A byte every 50 ms: each read is quick, the whole download is not."""
        self.send_response(200)
        self.send_header("Content-Length", "200")
        self.end_headers()
        try:
            for _ in range(200):
                self.wfile.write(b"\x00")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the client hung up, as it should
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def loopback_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.seen, server.hosts = [], []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def fetch_reason(url: str, policy: MediaPolicy) -> str:
    with pytest.raises(InvalidImage) as caught:
        fetch_bytes(url, policy)
    return caught.value.reason


def test_ssrf_to_loopback_never_contacts_the_server(loopback_server):
    server, base = loopback_server
    port = server.server_address[1]
    assert fetch_reason(f"{base}/img.png", MediaPolicy()) == "forbidden_url"  # no allow-list
    allowed = MediaPolicy(allowed_domains=("127.0.0.1", "localhost"))  # private not allowed
    assert fetch_reason(f"{base}/img.png", allowed) == "forbidden_url"
    assert fetch_reason(f"http://localhost:{port}/img.png", allowed) == "forbidden_url"
    assert fetch_reason(f"http://[::ffff:127.0.0.1]:{port}/", MediaPolicy(("*",))) == (
        "forbidden_url"
    )
    assert server.seen == []


def test_allowed_fetch_and_decode(loopback_server):
    server, base = loopback_server
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_addresses=True)
    assert fetch_bytes(f"{base}/img.png", policy) == PNG_BYTES
    assert fetch_image(f"{base}/img.png", policy).image.size == (20, 10)
    assert fetch_reason(f"{base}/missing", policy) == "fetch_failed"
    assert server.seen == ["/img.png", "/img.png", "/missing"]


def test_connects_to_the_resolved_address_with_the_host_name(loopback_server):
    server, _ = loopback_server
    port = server.server_address[1]
    policy = MediaPolicy(allowed_domains=("LocalHost.",), allow_private_addresses=True)
    assert fetch_bytes(f"http://localhost:{port}/img.png", policy) == PNG_BYTES
    assert server.hosts == [f"localhost:{port}"]


def test_byte_cap_on_downloads(loopback_server):
    server, base = loopback_server
    policy = MediaPolicy(("127.0.0.1",), allow_private_addresses=True, max_bytes=1000)
    assert fetch_reason(f"{base}/big", policy) == "too_large"
    assert fetch_reason(f"{base}/big-undeclared", policy) == "too_large"


def test_total_time_limit(loopback_server):
    _, base = loopback_server
    policy = MediaPolicy(("127.0.0.1",), allow_private_addresses=True, timeout_s=0.3)
    with pytest.raises(InvalidImage, match="time limit"):
        fetch_bytes(f"{base}/trickle", policy)


def test_redirects_same_host_only(loopback_server):
    server, base = loopback_server
    policy = MediaPolicy(("127.0.0.1", "localhost"), allow_private_addresses=True)
    assert fetch_bytes(f"{base}/same-host", policy) == PNG_BYTES
    assert server.seen == ["/same-host", "/img.png"]
    server.seen.clear()
    assert fetch_reason(f"{base}/other-host", policy) == "forbidden_url"
    assert server.seen == ["/other-host"]  # the redirect target was never requested
    no_redirects = MediaPolicy(("127.0.0.1",), allow_private_addresses=True, max_redirects=0)
    assert fetch_reason(f"{base}/same-host", no_redirects) == "fetch_failed"


def test_urls_refused_before_any_connection():
    policy = MediaPolicy(allowed_domains=("*",))
    assert fetch_reason("ftp://example.com/a.png", policy) == "forbidden_url"
    assert fetch_reason("http://user:pw@example.com/a.png", policy) == "forbidden_url"
    assert fetch_reason("gopher://x", policy) == "forbidden_url"
    assert fetch_reason("http://10.0.0.1/a.png", policy) == "forbidden_url"
    assert fetch_reason("http://[fe80::1]/a.png", policy) == "forbidden_url"
    assert fetch_reason("http://0.0.0.0/a.png", policy) == "forbidden_url"
    assert fetch_bytes(data_uri(PNG_BYTES), MediaPolicy()) == PNG_BYTES


@pytest.mark.parametrize(
    ("address", "forbidden"),
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("172.16.0.1", True),
        ("192.168.1.1", True),
        ("169.254.169.254", True),  # cloud metadata
        ("100.64.0.1", True),  # carrier-grade NAT
        ("0.0.0.0", True),
        ("224.0.0.1", True),
        ("255.255.255.255", True),
        ("::1", True),
        ("::", True),
        ("fe80::1", True),
        ("fc00::1", True),
        ("ff02::1", True),
        ("::ffff:127.0.0.1", True),
        ("::ffff:10.0.0.1", True),
        ("2002:7f00:1::", True),  # 6to4 around 127.0.0.1
        ("64:ff9b::a9fe:a9fe", True),  # NAT64 around 169.254.169.254
        ("8.8.8.8", False),
        ("1.1.1.1", False),
        ("2606:4700:4700::1111", False),
        ("::ffff:8.8.8.8", False),
    ],
)
def test_forbidden_addresses(address, forbidden):
    assert is_forbidden_address(ipaddress.ip_address(address)) is forbidden


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(PNG_BYTES)
    (tmp_path / "secret.png").write_bytes(PNG_BYTES)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    (allowed / "sub").mkdir()
    os.mkfifo(allowed / "pipe")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert fetch_bytes(f"file://{allowed}/cat.png", policy) == PNG_BYTES
    assert fetch_bytes(f"file://localhost{allowed}/cat.png", policy) == PNG_BYTES
    assert fetch_reason(f"file://{tmp_path}/secret.png", policy) == "forbidden_url"
    assert fetch_reason(f"file://{allowed}/../secret.png", policy) == "forbidden_url"
    assert fetch_reason(f"file://{allowed}/link.png", policy) == "forbidden_url"  # symlink out
    assert fetch_reason(f"file://{allowed}/sub", policy) == "forbidden_url"
    assert fetch_reason(f"file://{allowed}/pipe", policy) == "forbidden_url"
    assert fetch_reason(f"file://{allowed}/absent.png", policy) == "fetch_failed"
    assert fetch_reason(f"file://otherhost{allowed}/cat.png", policy) == "forbidden_url"
    assert fetch_reason(f"file://{allowed}/cat.png", MediaPolicy()) == "forbidden_url"
    small = MediaPolicy(allowed_local_media_path=str(allowed), max_bytes=10)
    assert fetch_reason(f"file://{allowed}/cat.png", small) == "too_large"
    with pytest.raises(ValueError, match="absolute"):
        MediaPolicy(allowed_local_media_path="relative/dir")
