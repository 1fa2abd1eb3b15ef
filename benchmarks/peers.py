"""The peer servers the served benchmarks run beside `axon serve`, by name: how each is built
(once, cached in ~/.cache/axon-bench) and the command that serves a GGUF file with it.

- `llama-server`: llama.cpp's, from the llama-cpp-python sdist (benchmarks/llama_server.py);
- `ik_llama.cpp`: ik_llama.cpp's server, from the ik-llama-cpp-python sdist, with run-time
  repack (benchmarks/ik_llama.py).

Both answer GET /health with 200 once the model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ik_llama
import llama_server


@dataclass(frozen=True)
class Peer:
    name: str
    build: Callable[[], Path]  # the server binary's path, built first when missing
    # (binary, model, port, ctx_per_slot, slots, threads) -> the command line
    command: Callable[..., list[str]]


PEERS = {
    "llama-server": Peer(
        "llama-server", llama_server.build_llama_server, llama_server.server_command
    ),
    ik_llama.NAME: Peer(ik_llama.NAME, ik_llama.build_ik_llama, ik_llama.server_command),
}


def build_peers(names: list[str]) -> dict[str, Path]:
    """{name: binary} for the peers named, built one at a time (each build takes both cores)."""
    return {name: PEERS[name].build() for name in names}
