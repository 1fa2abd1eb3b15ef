"""llama.cpp's `llama-server`, built from the sources vendored in the llama-cpp-python sdist and
launched on a GGUF file: the real peer of `axon serve`.

The binary is built once with cmake (`-DGGML_NATIVE=ON`, Release, no curl, server target only;
about 10+ minutes on 2 cores, under `nice`) into ~/.cache/axon-bench/llama-server-<version>/ and
reused when present. The sdist is the one tests/llama_cpp_sdist.py finds or downloads.

    python benchmarks/llama_server.py            # build (or find) it and print its path
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

CACHE = Path.home() / ".cache" / "axon-bench"
SDIST_DIRS = (
    Path.home() / ".cache" / "axon-test" / "llama-cpp-python",
    CACHE,
    Path("/tmp/lcp"),
)
VENDOR = "vendor/llama.cpp/"
CMAKE_FLAGS = [
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DCMAKE_BUILD_TYPE=Release",
]
# On a CPU that lists AMX, `-march=native` compiles ggml's AMX kernels in, and llama-server died
# at its first tile instruction (`tilezero`: trap invalid opcode, a Xeon VM, 2026-12-04). There
# the build names the native AVX-512 features one by one instead, without AMX.
NO_AMX_FLAGS = [
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512")),
    *(f"-DGGML_AVX512_{f}=ON" for f in ("VBMI", "VNNI", "BF16")),
]


def has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cmake_flags() -> tuple[list[str], str]:
    """(cmake flags, the binary's directory suffix): native, or native less AMX (see above)."""
    if not has_amx():
        return CMAKE_FLAGS, ""
    flags = [f for f in CMAKE_FLAGS if not f.startswith("-DGGML_NATIVE")] + NO_AMX_FLAGS
    return flags, "-noamx"


def find_sdist() -> Path:
    """The newest llama-cpp-python sdist already on disk, else one downloaded with pip."""
    for directory in SDIST_DIRS:
        found = sorted(directory.glob("llama_cpp_python-*.tar.gz")) if directory.is_dir() else []
        if found:
            return found[-1]
    SDIST_DIRS[0].mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*command, "llama-cpp-python", "-d", str(SDIST_DIRS[0])], check=True)
    return sorted(SDIST_DIRS[0].glob("llama_cpp_python-*.tar.gz"))[-1]


def sdist_version(sdist: Path) -> str:
    return sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")


def extract_sources(sdist: Path, target: Path, vendor: str = VENDOR) -> Path:
    """`vendor` (the sdist's vendored tree, default `vendor/llama.cpp/`) extracted once into
    `target`."""
    done = target / ".extracted"
    if done.exists():
        return target
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            if vendor in member.name:
                member.name = member.name.split(vendor, 1)[1]
                if member.name:
                    members.append(member)
        archive.extractall(target, members=members, filter="data")
    done.touch()
    return target


def cmake_build(
    source: Path | None,
    build: Path,
    flags: list[str],
    target: str,
    log: Path,
    jobs: int = 2,
    niceness: int = 10,
) -> None:
    """Configure `build` from `source` (unless None: already configured) and build `target`
    under `nice`, logging both to `log`; raises CalledProcessError on a failure."""
    nice = ["nice", "-n", str(niceness)]
    with log.open("w") as out:
        if source is not None:
            configure = [*nice, "cmake", "-S", str(source), "-B", str(build), *flags]
            subprocess.run(configure, stdout=out, stderr=subprocess.STDOUT, check=True)
        compile_ = [*nice, "cmake", "--build", str(build), "--target", target, "-j", str(jobs)]
        subprocess.run(compile_, stdout=out, stderr=subprocess.STDOUT, check=True)


def build_llama_server(jobs: int = 2) -> Path:
    """The path of a cached `llama-server` binary, configured and built first when missing
    (logged to ~/.cache/axon-bench/llama-server-<version>.log)."""
    sdist = find_sdist()
    version = sdist_version(sdist)
    flags, suffix = cmake_flags()
    binary = CACHE / f"llama-server-{version}{suffix}" / "llama-server"
    if binary.exists():
        return binary
    source = extract_sources(sdist, CACHE / f"llama-server-src-{version}")
    build = source / f"build{suffix}"
    log = CACHE / f"llama-server-{version}{suffix}.log"
    print(f"building llama-server {version} from {source} (log: {log}) ...", flush=True)
    cmake_build(source, build, flags, "llama-server", log, jobs)
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", binary.with_suffix(".tmp"))
    os.replace(binary.with_suffix(".tmp"), binary)
    return binary


def server_build_dir() -> Path:
    """llama-server's cmake build tree (its bin/ also holds libllama.so and the other tools)."""
    _, suffix = cmake_flags()
    return CACHE / f"llama-server-src-{sdist_version(find_sdist())}" / f"build{suffix}"


def requantize(model: Path, ftype: str, target: Path | None = None, jobs: int = 2) -> Path:
    """`model` (re)quantized to `ftype` (e.g. Q2_K, Q8_0) by llama.cpp's `llama-quantize`, built
    once in llama-server's build tree (no llama-cpp-python venv needed): a lower-bit copy of a
    model to draft for it, or a quantized benchmark file, cached as `target` (default
    ~/.cache/axon-bench/<stem>-<ftype>.gguf). Tensors whose shape the type cannot hold get
    llama-quantize's own fallback type."""
    target = target or CACHE / f"{model.stem}-{ftype}.gguf"
    if target.exists():
        return target
    build_llama_server(jobs)
    build = server_build_dir()
    tool = build / "bin" / "llama-quantize"
    if not tool.exists():
        flags, suffix = cmake_flags()
        log = CACHE / f"llama-quantize-{sdist_version(find_sdist())}{suffix}.log"
        cmake_build(None, build, flags, "llama-quantize", log, jobs)
    tmp = target.with_suffix(".tmp")
    command = [str(tool), "--allow-requantize", str(model), str(tmp), ftype]
    subprocess.run(command, check=True, capture_output=True)
    os.replace(tmp, target)
    return target


def server_command(
    binary: Path, model: Path, port: int, ctx_per_slot: int, slots: int, threads: int
) -> list[str]:
    """llama-server on `model` with `slots` parallel slots of `ctx_per_slot` tokens each: `-c`
    is the total, split evenly across the slots (`--no-kv-unified`; unified is its default
    only when the slot count is automatic). Prompt caching stays at its default (on)."""
    return [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-c", str(ctx_per_slot * slots), "-np", str(slots), "--no-kv-unified"),
        *("-t", str(threads), "-tb", str(threads)),
        *("--no-webui", "--alias", "llama-server"),
    ]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 600.0) -> float:
    """Seconds until GET `url` answers 200; raises if the process exits or time runs out."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


if __name__ == "__main__":
    print(build_llama_server())
