"""What this node is (`GET /discovery`) and how its devices are doing (`GET /health`).

GPU facts come from `nvidia-smi`; the HTTP process never opens a device itself. Without
`nvidia-smi` the device lists are empty, not an error. Parsers are pure functions of the text.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import time

NVIDIA_SMI = "nvidia-smi"
INVENTORY_QUERY = "index,name,memory.total,compute_cap,driver_version"
HEALTH_QUERY = "index,memory.used,memory.free,utilization.gpu,temperature.gpu"
HEALTH_TTL_S = 5.0  # neuron polls every 5 s; a /health burst costs one nvidia-smi run
_CUDA_VERSION_RE = re.compile(r"CUDA Version:\s*([\d.]+)")


def _number(text: str) -> int | None:
    """An nvidia-smi number (`81559`, `35.5`), or None for `[N/A]` and other non-numbers."""
    try:
        return round(float(text))
    except ValueError:
        return None


def _rows(csv_text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split(",")] for line in csv_text.splitlines() if line.strip()
    ]


def parse_gpu_inventory(csv_text: str) -> tuple[list[dict], str | None]:
    """Devices and driver version from the INVENTORY_QUERY csv (noheader, nounits)."""
    devices, driver = [], None
    for row in _rows(csv_text):
        if len(row) < 5 or _number(row[0]) is None:
            continue
        devices.append(
            {
                "index": _number(row[0]),
                "name": row[1],
                "vram_total_mb": _number(row[2]),
                "compute_capability": row[3] or None,
            }
        )
        driver = driver or row[4] or None
    return devices, driver


def parse_gpu_health(csv_text: str) -> list[dict]:
    """Per-device memory, utilisation and temperature from the HEALTH_QUERY csv."""
    devices = []
    for row in _rows(csv_text):
        if len(row) < 5 or _number(row[0]) is None:
            continue
        used, free, util, temp = (_number(cell) for cell in row[1:5])
        devices.append(
            {
                "index": _number(row[0]),
                "vram_used_mb": used,
                "vram_free_mb": free,
                "utilization_pct": util,
                "temp_c": temp,
            }
        )
    return devices


def parse_cuda_version(smi_text: str) -> str | None:
    """The driver's CUDA version from plain `nvidia-smi` output (`CUDA Version: 12.4`)."""
    match = _CUDA_VERSION_RE.search(smi_text)
    return match.group(1) if match else None


def parse_meminfo(text: str) -> dict:
    """Host memory from /proc/meminfo: `{total_bytes, available_bytes}` (None when absent)."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            values[name.strip()] = int(parts[0]) * scale
    return {"total_bytes": values.get("MemTotal"), "available_bytes": values.get("MemAvailable")}


def run_nvidia_smi(*args: str, timeout_s: float = 10.0) -> str | None:
    """stdout of `nvidia-smi ARGS`, or None when it is missing, fails or hangs."""
    if shutil.which(NVIDIA_SMI) is None:
        return None
    try:
        done = subprocess.run(
            [NVIDIA_SMI, *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _query(fields: str) -> str:
    return run_nvidia_smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits") or ""


@functools.cache
def gpu_indices() -> tuple[int, ...]:
    """The indices of this node's NVIDIA GPUs (empty without nvidia-smi); read once."""
    devices, _ = parse_gpu_inventory(_query(INVENTORY_QUERY))
    return tuple(device["index"] for device in devices)


def host_memory() -> dict:
    """Host memory (CPU models live here); empty values off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            return parse_meminfo(meminfo.read())
    except OSError:
        return {"total_bytes": None, "available_bytes": None}


def discover(harnesses: tuple[str, ...] = ("axon",)) -> dict:
    """The `GET /discovery` body: host, OS, kernel, CUDA/driver versions, GPUs, CPU."""
    uname = platform.uname()
    devices, driver = parse_gpu_inventory(_query(INVENTORY_QUERY))
    return {
        "hostname": uname.node,
        "os": uname.system,
        "kernel": uname.release,
        "cuda_version": parse_cuda_version(run_nvidia_smi() or "") if devices else None,
        "driver_version": driver,
        "devices": devices,
        "cpu": {"count": os.cpu_count(), "memory_total_bytes": host_memory()["total_bytes"]},
        "harnesses": list(harnesses),
    }


class HealthProbe:
    """Device health, refreshed at most every HEALTH_TTL_S s (each refresh runs nvidia-smi)."""

    def __init__(self, ttl_s: float = HEALTH_TTL_S, clock=time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._taken_at: float | None = None
        self._devices: list[dict] = []

    def devices(self) -> list[dict]:
        """Per-GPU health; blocking (nvidia-smi) when the cached value is stale."""
        now = self._clock()
        if self._taken_at is None or now - self._taken_at >= self.ttl_s:
            self._devices = parse_gpu_health(_query(HEALTH_QUERY))
            self._taken_at = now
        return self._devices
