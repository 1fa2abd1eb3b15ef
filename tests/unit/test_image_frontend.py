"""The HTTP side of images (axon.server.images): parts, limits, detail, placeholder expansion,
the media-policy config, and the memory the engine reserves for the tower."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from axon.multimodal.processor import ProcessorConfig
from axon.runner.memory import plan_kv_cache
from axon.server.config import load_config
from axon.server.errors import BadRequest
from axon.server.images import ImageFrontend, image_parts, media_policy
from axon.server.schemas.node_protocol import EngineArgs
from axon.server.serve_args import parse_mm_limits

IMAGE, START, END = 90, 91, 92
BAND = {"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 4096}  # patch 16, merge 2


def _info(**overrides) -> dict:
    info = {
        "image_token_id": IMAGE,
        "vision_start_token_id": START,
        "spatial_merge_size": 2,
        "max_images_per_prompt": 2,
        "max_image_pixels": None,
        "image_profile": "native",
    }
    return info | overrides


@pytest.fixture()
def checkpoint(tmp_path):
    config = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "size": BAND}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    return tmp_path


def _uri(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _parts(*urls: str, detail: str | None = None) -> list:
    image_url = [{"url": url} | ({"detail": detail} if detail else {}) for url in urls]
    content = [{"type": "image_url", "image_url": value} for value in image_url]
    return image_parts([{"role": "user", "content": content}])


def test_parts_in_order_with_their_params():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url",
                                                                    "image_url": "u1"}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "image", "url": "u2"}]},
    ]  # fmt: skip
    parts = image_parts(messages)
    assert [(p.url, p.param) for p in parts] == [
        ("u1", "messages[0].content[1]"),
        ("u2", "messages[2].content[0]"),
    ]
    for bad in ({"type": "image_url", "image_url": 3}, {"type": "image_url", "image_url": {}}):
        with pytest.raises(BadRequest) as error:
            image_parts([{"role": "user", "content": [bad]}])
        assert error.value.param == "messages[0].content[0].image_url"
    with pytest.raises(BadRequest, match="detail"):
        _parts("u", detail="ultra")


def test_low_detail_narrows_the_band(checkpoint):
    frontend = ImageFrontend.of(str(checkpoint), _info(), media_policy(None))
    high = frontend.load(_parts(_uri(1600, 1200), detail="high")).images[0]
    low = frontend.load(_parts(_uri(1600, 1200), detail="low")).images[0]
    assert high.num_tokens > low.num_tokens
    assert low.grid_thw[1] * low.grid_thw[2] * 16 * 16 <= 512 * 512


def test_engine_limits_shape_the_processor(checkpoint):
    capped = ImageFrontend.of(
        str(checkpoint), _info(max_image_pixels=64 * 64 * 4), media_policy(None)
    )
    image = capped.load(_parts(_uri(1600, 1200))).images[0]
    assert image.grid_thw[1] * image.grid_thw[2] * 16 * 16 <= 64 * 64 * 4
    fixed = ImageFrontend.of(str(checkpoint), _info(image_profile="fixed448"), media_policy(None))
    for size in ((1600, 1200), (50, 300)):
        assert fixed.load(_parts(_uri(*size))).images[0].grid_thw == (1, 28, 28)


def test_too_many_images_is_invalid_image(checkpoint):
    frontend = ImageFrontend.of(str(checkpoint), _info(max_images_per_prompt=2), media_policy(None))
    with pytest.raises(BadRequest) as error:
        frontend.load(_parts(_uri(32, 32), _uri(32, 32), _uri(32, 32)))
    assert error.value.code == "invalid_image" and error.value.param == "messages[0].content[2]"


def test_no_tower_or_no_preprocessor_means_no_images(tmp_path, checkpoint):
    assert ImageFrontend.of(str(checkpoint), None, None) is None
    assert ImageFrontend.of(str(tmp_path / "elsewhere"), _info(), media_policy(None)) is None


def test_expand_placeholders(checkpoint):
    frontend = ImageFrontend.of(str(checkpoint), _info(), media_policy(None))
    images = frontend.load(_parts(_uri(64, 32), _uri(32, 96)))
    counts = [image.num_tokens for image in images.images]
    ids = [1, START, IMAGE, END, 2, START, IMAGE, END, 3]
    expanded = frontend.expand(ids, images, "messages")
    assert expanded == (
        [1, START] + [IMAGE] * counts[0] + [END, 2, START] + [IMAGE] * counts[1] + [END, 3]
    )
    inputs = images.engine_inputs()
    assert inputs["pixel_values"].shape[0] == sum(np.prod(g) for g in inputs["grid_thw"])
    for wrong in ([1, START, IMAGE, END], [1, IMAGE, 2, IMAGE], ids + [START, IMAGE, END]):
        with pytest.raises(BadRequest) as error:
            frontend.expand(wrong, images, "messages")
        assert error.value.code == "invalid_image"


def test_media_settings_from_config_and_flags(tmp_path):
    toml = tmp_path / "axon.toml"
    toml.write_text(
        'allowed_media_domains = ["images.example.com"]\n'
        'allowed_local_media_path = "/srv/media"\nmax_image_bytes = 1000\n'
    )
    policy = media_policy(load_config(toml, environ={}))
    assert policy.allows_host("IMAGES.example.com") and not policy.allows_host("example.com")
    assert policy.allowed_local_media_path == "/srv/media" and policy.max_bytes == 1000
    assert not media_policy(load_config(None, environ={})).allowed_domains  # data: URIs only
    for bad in ('allowed_local_media_path = "relative"', "allowed_media_domains = 3"):
        toml.write_text(bad + "\n")
        with pytest.raises(ValueError, match="allowed_"):
            load_config(toml, environ={})


def test_limit_mm_per_prompt_forms():
    assert parse_mm_limits("image=0") == {"image": 0}
    assert parse_mm_limits('{"image": 4}') == {"image": 4}
    for bad in ("video=1", "image", "image=x"):
        with pytest.raises(Exception, match="image"):
            parse_mm_limits(bad)
    args = EngineArgs(limit_mm_per_prompt={"image": 0}, image_profile="fixed448").engine_args()
    assert args == {"max_images_per_prompt": 0, "image_profile": "fixed448"}
    with pytest.raises(ValueError):
        EngineArgs(limit_mm_per_prompt={"image": -1})


def test_memory_plan_leaves_the_tower_reserve_free(monkeypatch):
    import torch

    from axon.config import EngineConfig
    from axon.runner import memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 1 << 30)
    config = EngineConfig(model="unused", max_num_seqs=1 << 20, block_size=16)
    device = torch.device("cpu")
    free = plan_kv_cache(config, 1 << 10, 1 << 30, device)
    reserve = 512 << 20
    kept = plan_kv_cache(config, 1 << 10, 1 << 30, device, reserve_bytes=reserve)
    assert kept.reserved_bytes == reserve
    assert free.total_bytes - kept.total_bytes >= 0.9 * reserve - (16 << 10)
    assert "reserved for image encoding" in kept.describe()


def test_tower_reserve_covers_the_largest_image():
    from transformers import Qwen3_5VisionConfig

    from axon.models.qwen3_5_vision import Qwen3_5VisionTower

    config = Qwen3_5VisionConfig(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
        out_hidden_size=64, num_position_embeddings=16,
    )  # fmt: skip
    tower = Qwen3_5VisionTower(config)
    processor = ProcessorConfig(min_pixels=16 * 16 * 4, max_pixels=1 << 20, patch_size=16)
    patches = processor.max_patches
    assert patches == (1 << 20) // 256
    per_patch = tower.activation_bytes(patches) / patches
    # At least the fp32 pixels, the block's qkv and MLP tensors, for every patch.
    assert per_patch >= 4 * tower.patch_dim + 4 * (3 * 64 + 2 * 128)
    assert tower.activation_bytes(2 * patches) == 2 * tower.activation_bytes(patches)
