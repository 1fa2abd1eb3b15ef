"""ik_llama.cpp, the second peer: its `llama-server` and its `libllama.so`, built from the
sources vendored in the `ik-llama-cpp-python` sdist.

The sdist lacks `common/cmake/build-info-gen-cpp.cmake`, the script its build runs to write
`common/build-info.cpp`; the file is written here from `build-info.cpp.in` before configuring
(cmake then finds the output present and has nothing to run). One cmake build (native, shared
libraries, target llama-server) gives both the server and the library that
benchmarks/llamacpp_worker.py loads in-process. No AMX build variant: ik_llama.cpp has no AMX
kernels, so `-march=native` emits no tile instruction.

It runs with `-rtr` (run-time repack: weights repacked at load into its row-interleaved
layouts, its fast CPU path) and, with more than one slot, `-no-fa`: its flash-attention kernel
asserted at 16 slots on the demo file (2026-12). Its flash-attention kernels are built for F16
and Q8_0 caches only (`GGML_IQK_FA_ALL_QUANTS=OFF`; the cache here is F16): the instances for
every quant type were most of its compile time on 2 shared cores. (`GGML_IQK_FLASH_ATTENTION=OFF`
does not link in this version: ggml still calls the kernels.)

    python benchmarks/ik_llama.py       # build (or find) it and print the server's path
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

from llama_server import CACHE, cmake_build, extract_sources

SDIST_GLOB = "ik_llama_cpp_python-*.tar.gz"
VENDOR = "vendor/ik_llama.cpp/"
CMAKE_FLAGS = [
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_CCACHE=OFF",
    "-DGGML_IQK_FA_ALL_QUANTS=OFF",  # see the module's docstring
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # the server is one of its examples; only its target is built
    "-DLLAMA_BUILD_SERVER=ON",
    "-DCMAKE_BUILD_TYPE=Release",
]
NAME = "ik_llama.cpp"


def find_sdist() -> Path:
    """The newest ik-llama-cpp-python sdist in the cache, else one downloaded with pip."""
    found = sorted(CACHE.glob(SDIST_GLOB))
    if found:
        return found[-1]
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*command, "ik-llama-cpp-python", "-d", str(CACHE)], check=True)
    return sorted(CACHE.glob(SDIST_GLOB))[-1]


def sdist_version(sdist: Path) -> str:
    return sdist.name.removeprefix("ik_llama_cpp_python-").removesuffix(".tar.gz")


def write_build_info(source: Path, version: str) -> None:
    """common/build-info.cpp from its `.in`, with what the missing generator would fill in."""
    template = (source / "common" / "build-info.cpp.in").read_text()
    compiler = subprocess.run(["cc", "--version"], capture_output=True, text=True)
    target = subprocess.run(["cc", "-dumpmachine"], capture_output=True, text=True)
    values = {
        "@BUILD_NUMBER@": "0",
        "@BUILD_COMMIT@": f"ik-llama-cpp-python-{version}",
        "@BUILD_COMPILER@": compiler.stdout.splitlines()[0] if compiler.stdout else "cc",
        "@BUILD_TARGET@": target.stdout.strip(),
    }
    for key, value in values.items():
        template = template.replace(key, value.replace('"', "'"))
    (source / "common" / "build-info.cpp").write_text(template)


def build_dir() -> tuple[Path, str]:
    """(the build directory, the sdist's version)."""
    sdist = find_sdist()
    version = sdist_version(sdist)
    return CACHE / f"ik-llama-server-src-{version}" / "build", version


def build_ik_llama(jobs: int = 2) -> Path:
    """The path of ik_llama.cpp's `llama-server`, configured and built first when missing
    (logged to ~/.cache/axon-bench/ik-llama-server-<version>.log). It links the build's own
    libllama.so / libggml.so by rpath, so it runs from the build directory."""
    build, version = build_dir()
    binary, done = build / "bin" / "llama-server", build / ".built"
    if done.exists() and binary.exists():
        return binary
    source = extract_sources(find_sdist(), build.parent, VENDOR)
    write_build_info(source, version)
    log = CACHE / f"ik-llama-server-{version}.log"
    print(f"building ik_llama.cpp {version} from {source} (log: {log}) ...", flush=True)
    cmake_build(source, build, CMAKE_FLAGS, "llama-server", log, jobs, niceness=19)
    done.touch()
    return binary


def library_path() -> Path:
    """The built libllama.so (after build_ik_llama), for the in-process worker."""
    build, _ = build_dir()
    found = sorted(build.rglob("libllama.so"))
    if not found:
        raise FileNotFoundError(f"no libllama.so under {build}: build_ik_llama() first")
    return found[0]


def python_package() -> Path:
    """A directory holding the sdist's `ik_llama_cpp` ctypes bindings (extracted once), to put
    on the worker's PYTHONPATH; they load the library named by IK_LLAMA_CPP_LIB_PATH."""
    sdist = find_sdist()
    target = CACHE / f"ik-llama-cpp-python-{sdist_version(sdist)}"
    if not (target / "ik_llama_cpp" / "_ctypes_api.py").exists():
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if "/ik_llama_cpp/" in m.name]
            for member in members:
                member.name = "ik_llama_cpp/" + member.name.split("/ik_llama_cpp/", 1)[1]
            archive.extractall(target, members=members, filter="data")
    return target


def server_command(
    binary: Path, model: Path, port: int, ctx_per_slot: int, slots: int, threads: int
) -> list[str]:
    """ik_llama.cpp's server on `model` with `slots` slots of `ctx_per_slot` tokens each (its
    `-c` is split evenly across `-np` slots), run-time repack on, flash attention off at more
    than one slot (see the module's docstring)."""
    command = [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-c", str(ctx_per_slot * slots), "-np", str(slots)),
        *("-t", str(threads), "-tb", str(threads)),
        *("-rtr", "--alias", NAME),
        "--log-disable",  # its trace log, else written to ./llama.log
    ]
    return command + (["-no-fa"] if slots > 1 else [])


if __name__ == "__main__":
    print(build_ik_llama())
