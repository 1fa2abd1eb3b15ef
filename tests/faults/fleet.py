"""A real `axon serve` with several copies of the tiny chat model, each in its own engine
process, for the fault tests: kill, stop and wedge engines, flood and starve the HTTP edge."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.server.conftest import spawn_serve, stop_server


@dataclass
class Fleet:
    process: subprocess.Popen
    base_url: str
    log: list[str]

    def models(self) -> dict[str, dict]:
        infos = httpx.get(self.base_url + "/models", timeout=10).json()
        return {info["id"]: info for info in infos}

    def status(self, model: str) -> str | None:
        return self.models().get(model, {}).get("status")

    def engine_pid(self, model: str) -> int:
        return self.models()[model]["engine_pid"]

    def complete(self, model: str, timeout: float = 30, **extra) -> httpx.Response:
        body = {"model": model, "prompt": "w10 w11 w12", "max_tokens": 3, **extra}
        return httpx.post(self.base_url + "/v1/completions", json=body, timeout=timeout)

    def wait_loaded(self, model: str, deadline_s: float) -> list[str]:
        """Polls until `model` is loaded again; returns every status seen on the way."""
        seen, deadline = [], time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            status = self.status(model)
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == "loaded":
                return seen
            time.sleep(0.05)
        raise AssertionError(f"{model} not loaded again within {deadline_s}s: {seen}")

    def metric(self, name: str, model: str) -> float:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        pattern = rf'^{re.escape(name)}\{{model_name="{re.escape(model)}"\}} (\S+)$'
        match = re.search(pattern, text, re.M)
        return float(match.group(1)) if match else 0.0

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def launch(model_dir: Path, models: dict[str, dict], env: dict[str, str], flags=()) -> Fleet:
    """`axon serve` with one engine per entry of `models` (served name -> engine args), all of
    the checkpoint at `model_dir`; returns once every one of them is loaded."""
    specs = [
        {"model_id": str(model_dir), "served_model_name": name, **args}
        for name, args in models.items()
    ]
    toml = "[" + ", ".join(_inline_table(spec) for spec in specs) + "]"
    args = ["--port", "0", "--no-demo", "--max-model-len", "2048", "--dtype", "float32"]
    args += ["--kv-cache-memory", "32M", "--log-level", "warning", *flags]
    fleet = spawn_serve(args, {"AXON_DEFAULT_MODELS": toml, **env}, kind=Fleet)
    try:
        for name in models:
            fleet.wait_loaded(name, 180)
    except BaseException:
        stop_fleet(fleet)
        raise
    return fleet


def stop_fleet(fleet: Fleet) -> None:
    stop_server(fleet)  # SIGTERM, then the process group's SIGKILL


def _inline_table(spec: dict) -> str:
    return "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in spec.items()) + "}"


def children(pid: int) -> set[int]:
    """The direct children of `pid` (Linux /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.update(int(child) for child in text)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"
