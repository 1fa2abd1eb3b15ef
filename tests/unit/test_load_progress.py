"""Load progress (axon.loader.progress): bytes per tensor kind, monotonic reports ending at the
checkpoint's size, the reporter and the terminal bar never on a pipe."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from axon.layers.quantized import QuantizedTensor
from axon.loader import progress
from axon.loader.safetensors import CheckpointSlice, iterate_safetensors


def test_tensor_bytes_of_every_kind(tmp_path):
    assert progress.tensor_bytes(torch.zeros(3, 4, dtype=torch.bfloat16)) == 24
    raw = torch.zeros(2, 18, dtype=torch.uint8)  # two Q4_0 rows of one block
    assert progress.tensor_bytes(QuantizedTensor(2, raw, (2, 32))) == 36
    save_file({"w": torch.zeros(8, 6)}, str(tmp_path / "model.safetensors"))
    ((_, lazy),) = list(iterate_safetensors(str(tmp_path), sliced=True))
    assert isinstance(lazy, CheckpointSlice) and progress.tensor_bytes(lazy) == 8 * 6 * 4


def test_reports_are_monotonic_and_end_at_the_total(tmp_path, monkeypatch):
    tensors = {f"t{i}": torch.zeros(64, 64) for i in range(6)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reports: list[tuple[int, int]] = []
    monkeypatch.setattr(progress, "REPORT_INTERVAL_S", 0.0)
    progress.set_reporter(lambda loaded, total: reports.append((loaded, total)))
    try:
        names = [name for name, _ in progress.track(iterate_safetensors(str(tmp_path)), tmp_path)]
    finally:
        progress.set_reporter(None)
    total = (tmp_path / "model.safetensors").stat().st_size
    assert sorted(names) == sorted(tensors)
    assert reports[0] == (64 * 64 * 4, total)  # counted once the loader took the tensor
    assert [loaded for loaded, _ in reports] == sorted(loaded for loaded, _ in reports)
    assert reports[-1] == (total, total) and len(reports) == len(tensors) + 1


def test_no_reporter_no_bar_off_a_terminal(tmp_path, capsys):
    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    assert [n for n, _ in progress.track(iterate_safetensors(str(tmp_path)), tmp_path)] == ["w"]
    assert "loading weights" not in capsys.readouterr().err  # pytest's stderr is no terminal
