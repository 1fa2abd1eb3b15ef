"""The models dirs' scan (lifecycle/catalog.py): which files and folders are models, under
which id, and that nothing outside a dir is taken through a symlink."""

from __future__ import annotations

import os
from pathlib import Path

from axon.server.lifecycle.catalog import Catalog, default_models_dirs, scan


def _file(path: Path, size: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return path


def _dense(folder: Path) -> Path:
    _file(folder / "config.json")
    _file(folder / "model.safetensors", 100)
    return folder


def _ids(found: dict) -> dict[str, tuple[str, Path]]:
    return {model_id: (model.format, model.path) for model_id, model in found.items()}


def test_gguf_files_and_safetensors_folders_two_levels_deep(tmp_path):
    root = tmp_path / "models"
    top = _file(root / "SmolLM2-135M-Instruct.Q4_1.gguf", 40)
    nested = _file(root / "qwen" / "Qwen3-0.6B-Q8_0.gguf")
    first = _file(root / "big" / "Big-Q4_K_M-00001-of-00002.gguf")
    _file(root / "big" / "Big-Q4_K_M-00002-of-00002.gguf")
    dense = _dense(root / "tiny-llama")
    _file(root / "no-config" / "model.safetensors")  # weights without a config: not a model
    _file(root / ".partial.gguf.tmp")
    _file(root / ".hidden.gguf")
    _file(root / "a" / "b" / "too-deep.gguf")
    _file(root / "notes.txt")

    found = scan((str(root),))

    assert _ids(found) == {
        "SmolLM2-135M-Instruct.Q4_1": ("gguf", top),
        "Qwen3-0.6B-Q8_0": ("gguf", nested),
        "Big-Q4_K_M": ("gguf", first),
        "tiny-llama": ("safetensors", dense),
    }
    assert found["tiny-llama"].size_bytes == 100 and found["tiny-llama"].root == root
    assert found["SmolLM2-135M-Instruct.Q4_1"].size_bytes == 40


def test_hf_cache_repos_are_org_name_at_their_current_snapshot(tmp_path):
    hub = tmp_path / "hub"
    repo = hub / "models--HuggingFaceTB--SmolLM2-135M"
    blob = _file(repo / "blobs" / "abc123", 64)
    _file(repo / "blobs" / "cfg")
    for revision in ("old", "main1"):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").symlink_to(repo / "blobs" / "cfg")
        (snapshot / "model.safetensors").symlink_to(blob)
    _file(repo / "refs" / "main").write_text("main1")
    gguf_repo = hub / "models--bartowski--Qwen3-GGUF" / "snapshots" / "r1"
    _file(gguf_repo / "Qwen3-0.6B-Q4_K_M.gguf")
    _file(hub / "datasets--org--data" / "snapshots" / "r" / "x.gguf")  # not a model repo

    found = scan((str(hub),))

    assert found["HuggingFaceTB/SmolLM2-135M"].path == repo / "snapshots" / "main1"
    assert found["HuggingFaceTB/SmolLM2-135M"].size_bytes == 64  # the blob, links followed
    assert found["Qwen3-0.6B-Q4_K_M"].format == "gguf"
    assert set(found) == {"HuggingFaceTB/SmolLM2-135M", "Qwen3-0.6B-Q4_K_M"}


def test_nothing_outside_the_dir_is_taken_through_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    secret = _file(outside / "secret.gguf")
    _dense(outside / "model")
    root = tmp_path / "models"
    root.mkdir()
    (root / "linked.gguf").symlink_to(secret)
    (root / "linked-model").symlink_to(outside / "model", target_is_directory=True)
    half = root / "half"  # its config is inside, its weights are not
    _file(half / "config.json")
    (half / "model.safetensors").symlink_to(_file(outside / "w.safetensors"))
    inside = _file(root / "store" / "real.gguf")
    (root / "store" / "alias.gguf").symlink_to(inside)  # a link inside the dir is fine
    _file(root / "beside-a-link.gguf")  # its folder (the root) links out: it could not load

    found = scan((str(root),))

    assert set(found) == {"real", "alias"}
    assert found["alias"].path == inside


def test_the_first_dir_wins_a_shared_id_and_missing_dirs_are_skipped(tmp_path):
    first = _file(tmp_path / "one" / "m.gguf")
    _file(tmp_path / "two" / "m.gguf")
    _file(tmp_path / "two" / "n.gguf")

    found = scan((str(tmp_path / "one"), str(tmp_path / "missing"), str(tmp_path / "two")))

    assert found["m"].path == first and set(found) == {"m", "n"}


def test_the_catalog_rescans_after_its_ttl(tmp_path):
    now = [0.0]
    catalog = Catalog((str(tmp_path),), ttl_s=2.0, clock=lambda: now[0])
    assert catalog.models() == {}
    _file(tmp_path / "new.gguf")
    assert catalog.models() == {}  # within the ttl: the last scan
    now[0] = 2.0
    assert set(catalog.models()) == {"new"}
    assert Catalog(()).models() == {}


def test_default_dirs_are_axons_model_cache_and_the_hf_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path / "axon"))
    dirs = default_models_dirs({"HF_HOME": str(tmp_path / "hf")})
    assert dirs == (str(tmp_path / "axon" / "models"), os.path.join(tmp_path, "hf", "hub"))
    assert default_models_dirs({"HF_HUB_CACHE": "/cache/hub"})[1] == "/cache/hub"
