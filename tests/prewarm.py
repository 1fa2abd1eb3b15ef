"""`python tests/prewarm.py`: fills ~/.cache/axon-test with what the suite's first run would
otherwise build inside its tests, so that a fresh machine's first run costs what a later one
does. scripts/setup.sh runs it in the background, beside axon's own prewarm.

Beside everything else, the bytecode of src/ and tests/, pytest's assertion-rewritten test
modules included: every xdist worker imports every test module to collect the suite, and
rewriting the asserts of ~150 test files costs a worker ~4 s of CPU when no cached copy is there.
It is written even under PYTHONDONTWRITEBYTECODE, which stops a run from writing bytecode but
not from reading it, so that such runs find it too (in the __pycache__ folders git ignores).

In order: the kernel variants (tests/c_builds.py); then, at once, the GGUF files llama.cpp's
converter makes of the tiny Qwen3-MoE / Qwen3.5 checkpoints (the fixtures themselves, set up by
`pytest --setup-only`, so the files are the ones the tests would make); beside them, the
tokenizers transformers reads from llama.cpp's vocab GGUFs (tests/tokenizer/test_real_vocab.py's
cache) and transformers' greedy tokens on the demo model (tests/quant/test_demo_model.py's).
Each entry is filled under the cache lock the tests take, so a run started meanwhile waits for
it rather than building it twice. Every failure is reported and left to the tests to redo.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# A test of each fixture that runs llama.cpp's converter (or extracts what it needs).
FIXTURE_TESTS = (
    "tests/quant/test_gguf_moe.py::test_config_comes_from_metadata",
    "tests/quant/test_gguf_moe.py::test_qwen35moe_config_comes_from_metadata",
    "tests/quant/test_gguf_qwen3_5.py::test_config_comes_from_metadata",
    "tests/quant/test_gguf_qwen3_5_mtp.py::test_the_gguf_nextn_block_loads_as_mtp",
    "tests/engine/test_tensor_parallel_moe.py::test_gguf_q8_0_experts_shard_and_equal_tp1",
)


def bytecode() -> subprocess.Popen:
    """src/ and tests/ compiled, and the test modules collected (which writes the rewritten
    bytecode pytest reads back), in a process that may write bytecode."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    compile_all = [sys.executable, "-m", "compileall", "-q", "src", "tests"]
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    script = f"{shlex.join(compile_all)}; {shlex.join(collect)} >/dev/null"
    return subprocess.Popen(
        ["sh", "-c", script],
        cwd=TESTS.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def kernel_variants() -> list[str]:
    """Builds tests/c_builds.py's variants, one compiler per core but one."""
    import c_builds

    with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1)) as pool:
        built = pool.map(c_builds._build_or_say, c_builds.VARIANTS)
        return [f"test kernel builds: {line}" for line in built]


def fixtures() -> subprocess.Popen:
    """`pytest --setup-only` of FIXTURE_TESTS, in its own process (pytest sets up the
    checkpoints and runs the converter exactly as the tests' fixtures do)."""
    command = [sys.executable, "-m", "pytest", "--setup-only", "-q", "-p", "no:cacheprovider"]
    command += ["-n", "0", *FIXTURE_TESTS]
    return subprocess.Popen(
        command, cwd=TESTS.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def vocab_tokenizers() -> list[str]:
    """llama.cpp's template corpus extracted, and test_real_vocab's cached tokenizer of every
    vocab GGUF it reads."""
    from llama_cpp_sdist import extract_llama_cpp
    from tokenizer.conftest import MODELS_IN_LLAMA_CPP, _wanted
    from tokenizer.test_real_vocab import GGUF_VOCABS, UNCONVERTIBLE, gguf_tokenizer

    extract_llama_cpp("models/templates/", lambda rest: rest.endswith(".jinja"), "-templates")
    models = extract_llama_cpp(MODELS_IN_LLAMA_CPP, _wanted)
    for name in (*sorted(GGUF_VOCABS), *UNCONVERTIBLE):
        with contextlib.suppress(ValueError):  # kept as the error the test expects
            gguf_tokenizer(models / f"ggml-vocab-{name}.gguf")
    return [f"vocab tokenizers: {len(GGUF_VOCABS) + len(UNCONVERTIBLE)} ready"]


def tp_gguf_tokenizer() -> list[str]:
    """axon's cached tokenizer of the tensor-parallel MoE test's GGUF file, the one converter
    file a test loads through `LLM` (its 151k-token vocabulary: ~25 s to read)."""
    from axon.tokenizer.gguf_tokenizer import load_gguf_tokenizer
    from llama_cpp_sdist import CACHE

    files = sorted(CACHE.glob("qwen3moe-tp-gguf/*/q8_0.gguf"), key=lambda p: p.stat().st_mtime)
    if files:
        load_gguf_tokenizer(files[-1])  # the newest: the one the fixture just made or reused
    return [f"tensor-parallel GGUF tokenizer: {'ready' if files else 'no file'}"]


def demo_reference() -> list[str]:
    """test_demo_model's transformers greedy tokens on the demo GGUF (a minute of numpy
    dequantizing and generating), keyed as the test keys them: the prompts as `LLM` tokenizes
    them."""
    from axon.demo import demo_model_path
    from axon.tokenizer.loading import load_tokenizer
    from quant.test_demo_model import PROMPTS, _transformers_greedy

    try:
        path = demo_model_path()
    except FileNotFoundError:
        return ["demo reference: no demo model"]
    tokenizer = load_tokenizer(str(path))
    _transformers_greedy(path, [tokenizer.encode(prompt) for prompt in PROMPTS])
    return ["demo reference: ready"]


def main() -> int:
    sys.path[:0] = [str(TESTS), str(TESTS.parent / "src")]
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' and the converter's progress bars
    started = time.monotonic()
    compiling = bytecode()
    for line in kernel_variants():
        print(line, flush=True)
    process = fixtures()
    lines = []
    for step in (vocab_tokenizers, demo_reference):
        try:
            lines += step()
        except Exception as exc:  # the tests build it again, and report it properly
            lines.append(f"{step.__name__}: not built ({type(exc).__name__}: {exc})")
    output = process.communicate()[0]
    if process.returncode == 0:
        lines += ["GGUF fixtures: ready", *tp_gguf_tokenizer()]
    else:
        status = process.returncode
        lines.append(f"GGUF fixtures: not built (pytest exit {status}): {output[-500:]}")
    output = compiling.communicate()[0]
    status = compiling.returncode
    lines.append("bytecode: ready" if status == 0 else f"bytecode: exit {status}: {output[-500:]}")
    for line in lines:
        print(line, flush=True)
    print(f"test caches ready in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
