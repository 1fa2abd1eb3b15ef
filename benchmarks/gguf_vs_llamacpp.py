"""axon against llama.cpp on the same GGUF file, same prompts, same machine, same run.

For each model it measures, on both engines (each in a fresh process, alternating, best of
--repeats): resident memory after load (RSS minus the runtime's own), prefill tok/s (one
--prefill-len prompt), batch-1 decode tok/s ((N - 1) / (time(N tokens) - time(1 token))), and
aggregate output tok/s at 4 and 16 concurrent streams (greedy, ignore EOS, prefill included).
Decode bandwidth is the weight bytes a decode step reads (every tensor but an untied input
embedding, of which it gathers one row per token) times decode tok/s.

llama.cpp is llama-cpp-python's batched C API (benchmarks/llamacpp_worker.py) in --llamacpp-venv
(default ~/.cache/axon-bench/llamacpp-venv). When it is missing, the venv gets the sdist's
bindings on the libllama.so of llama-server's build tree if that exists (seconds), else the
wheel built from the sdist (about 11 minutes on 2 cores, logged to <venv>.log). ik_llama.cpp,
the second peer (--peers), runs the same worker on its own libllama.so and the
ik-llama-cpp-python sdist's ctypes bindings, with its run-time repack (benchmarks/ik_llama.py
builds it with its server). Each peer has its columns and a ratio row per axon variant.

    PYTHONPATH=src python benchmarks/gguf_vs_llamacpp.py                # the demo model
    PYTHONPATH=src python benchmarks/gguf_vs_llamacpp.py --qwen3        # + Qwen3-shaped Q8_0, Q4_K
    PYTHONPATH=src python benchmarks/gguf_vs_llamacpp.py --model x.gguf --threads 1
    PYTHONPATH=src python benchmarks/gguf_vs_llamacpp.py --busy-core --decode-only

--busy-core [CPU] runs a fixed synthetic load during both engines' measurements: one process
spinning in a tight Python loop, pinned to CPU (default 1) with sched_setaffinity, the way a
second program busy on one core of the machine would be. --axon-env KEY=VALUE sets environment
variables for one more axon worker, alternated with the others in the same run (e.g.
--axon-env OMP_WAIT_POLICY=ACTIVE --axon-env GOMP_SPINCOUNT=300000, to compare thread policies).

--activation-precision float32 int8 runs one axon per precision in the same run, alternated with
the rest ("axon" is float32, the exact default; "axon int8" the opt-in 8-bit activations).

--qwen3 writes the random Qwen3 model of benchmarks/offline_throughput.py as an F16 GGUF (with
gguf-py and a placeholder vocab: prompts are token ids) and quantizes it with llama.cpp's
`llama_model_quantize` to Q8_0 and Q4_K_M, into ~/.cache/axon-bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from inprocess_table import table

BENCH = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "axon-bench"
PEER_NAMES = ("llama.cpp", "ik_llama.cpp")


# ---- llama.cpp ------------------------------------------------------------------------------


def ensure_llamacpp(venv: Path) -> Path:
    """The venv's python, after building llama-cpp-python into it when it does not import (on a
    CPU that lists AMX: a separate venv built without AMX, see llama_server.NO_AMX_FLAGS)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from llama_server import NO_AMX_FLAGS, has_amx

    env = dict(os.environ)
    if has_amx():
        venv = venv.with_name(venv.name + "-noamx")
        env["CMAKE_ARGS"] = " ".join(NO_AMX_FLAGS)
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import llama_cpp, numpy"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    if venv_on_server_build(venv):
        return python
    log = venv.with_suffix(".log")
    print(f"building llama-cpp-python into {venv} (log: {log}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    with log.open("w") as out:
        subprocess.run(
            # no cached wheel: one built for another CPU (or with AMX) would be reused
            [str(python), "-m", "pip", "install", "-v", "--no-cache-dir", "llama-cpp-python"]
            + ["numpy"],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
            env=env,
        )
    return python


def venv_on_server_build(venv: Path) -> bool:
    """Make `venv` import llama-cpp-python without building it again, where llama-server's build
    tree (benchmarks/llama_server.py: the same sdist's llama.cpp, the same cmake flags) already
    holds libllama.so: the sdist's ctypes bindings, with their `lib` directory linked to that
    build's libraries, and the bindings' pure-Python dependencies. False where there is no such
    build (the caller then builds the wheel)."""
    from llama_server import find_sdist, server_build_dir

    libs = server_build_dir() / "bin"
    if not (libs / "libllama.so").exists():
        return False
    python = venv / "bin" / "python"
    print(f"llama-cpp-python in {venv} on the libraries of {libs} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "numpy", "diskcache", "jinja2"]
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not axon's src/
    subprocess.run([*pip, "typing_extensions"], check=True, env=clean)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    with tarfile.open(find_sdist()) as archive:
        members = [m for m in archive.getmembers() if "/llama_cpp/" in m.name]
        for member in members:
            member.name = "llama_cpp/" + member.name.split("/llama_cpp/", 1)[1]
        archive.extractall(site, members=members, filter="data")
    lib = Path(site) / "llama_cpp" / "lib"
    lib.unlink(missing_ok=True)
    lib.symlink_to(libs, target_is_directory=True)
    probe = [str(python), "-c", "import llama_cpp, numpy"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def quantize(python: Path, source: Path, target: Path, ftype: str) -> Path:
    """llama.cpp's quantizer (LLAMA_FTYPE_MOSTLY_<ftype>) from `source` to `target`, once."""
    if target.exists():
        return target
    code = (
        "import llama_cpp as ll, sys\n"
        "p = ll.llama_model_quantize_default_params()\n"
        f"p.ftype = ll.LLAMA_FTYPE_MOSTLY_{ftype}\n"
        "sys.exit(ll.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
    )
    tmp = target.with_suffix(".tmp")
    subprocess.run([str(python), "-c", code, str(source), str(tmp)], check=True)
    os.replace(tmp, target)
    return target


# ---- axon -----------------------------------------------------------------------------------


def axon_worker(job: dict) -> dict:
    """axon's side of one measurement (in its own process: see main)."""
    from axon.runner.threads import apply_thread_policy

    policy = apply_thread_policy()  # as the engine process does: before torch loads libgomp
    import torch
    import transformers

    from axon import LLM, SamplingParams
    from axon.kernels import ggml_cpu

    torch.set_num_threads(policy.threads)  # --threads, unless an --axon-env variant sets it
    _ = transformers.AutoConfig, transformers.AutoTokenizer, ggml_cpu.available()
    base = _rss()
    llm = LLM(
        model=job["model"],
        max_model_len=job["n_ctx"],
        kv_cache_memory=job["kv_bytes"],
        max_num_seqs=max(job["streams"]),
        max_num_batched_tokens=2048,
        activation_precision=job.get("activation_precision", "float32"),
    )

    def run(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start

    run([job["decode_prompt"][:8]], 2)  # warm up
    resident = _rss() - base  # as llama.cpp's: after a warm-up has touched the mapped weights
    prefill = run([job["prefill_prompt"]], 1)
    one = run([job["decode_prompt"]], 1)
    full = run([job["decode_prompt"]], job["decode_tokens"])
    streams = {}
    for count in job["streams"]:
        elapsed = run(job["stream_prompts"][:count], job["stream_tokens"])
        streams[str(count)] = count * job["stream_tokens"] / elapsed
    return {
        "rss_bytes": resident,
        "prefill_tok_s": len(job["prefill_prompt"]) / prefill,
        "decode_tok_s": (job["decode_tokens"] - 1) / (full - one),
        "streams_tok_s": streams,
    }


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


# ---- the run --------------------------------------------------------------------------------


def make_job(model: Path, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(1000, vocab - 1000) for _ in range(length)]

    streams = max(args.streams)
    return {
        "model": str(model),
        "threads": args.threads,
        "n_ctx": 1024,
        "kv_bytes": args.kv_bytes,
        "prefill_prompt": prompt(args.prefill_len),
        "decode_prompt": prompt(args.decode_prompt_len),
        "decode_tokens": args.decode_tokens,
        "streams": list(args.streams),
        "stream_prompts": [prompt(args.stream_prompt_len) for _ in range(streams)],
        "stream_tokens": args.stream_tokens,
    }


def run_worker(command: list[str], job: dict, extra_env: dict[str, str]) -> dict:
    # --threads on every core: axon's own policy (which then adapts the count to a busy core)
    every_core = job["threads"] == len(os.sched_getaffinity(0))
    count = {} if every_core else {"OMP_NUM_THREADS": str(job["threads"])}
    env = {**os.environ, **count, **extra_env}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(
            None,
            [str(BENCH.parent / "src"), extra_env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")],
        )
    )
    done = subprocess.run(command, input=json.dumps(job), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best(results: list[dict]) -> dict:
    """The best of each number over the repeats (the machine may be shared)."""
    out = {k: max(r[k] for r in results) for k in ("prefill_tok_s", "decode_tok_s")}
    out["rss_bytes"] = min(r["rss_bytes"] for r in results)
    out["streams_tok_s"] = {
        k: max(r["streams_tok_s"][k] for r in results) for k in results[0]["streams_tok_s"]
    }
    return out


def peer_engines(llama_python: Path | None, job: dict, peers: list[str]) -> dict:
    """{name: (command, extra environment, job)} of each peer's worker."""
    worker = str(BENCH / "llamacpp_worker.py")
    engines = {}
    if "llama.cpp" in peers:
        engines["llama.cpp"] = ([str(llama_python), worker], {}, job)
    if "ik_llama.cpp" in peers:
        import ik_llama

        ik_llama.build_ik_llama()
        env = {
            "IK_LLAMA_CPP_LIB_PATH": str(ik_llama.library_path()),
            "PYTHONPATH": str(ik_llama.python_package()),
        }
        engines["ik_llama.cpp"] = ([sys.executable, worker], env, {**job, "engine": "ik_llama.cpp"})
    return engines


def compare(model: Path, llama_python: Path | None, args: argparse.Namespace) -> dict:
    from gguf import GGUFReader

    vocab = len(GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].data)
    job = make_job(model, args, vocab)
    axon_cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    engines = {}  # name: (command, extra environment, job)
    for precision in args.activation_precision:  # one axon per precision, alternated
        name = "axon" if precision == "float32" else f"axon {precision}"
        engines[name] = (axon_cmd, {}, {**job, "activation_precision": precision})
    first = {**job, "activation_precision": args.activation_precision[0]}
    for variant in args.axon_env:  # each --axon-env is one more axon, alternated with the rest
        extra = dict(i.split("=", 1) for i in variant.split(","))
        engines[f"axon {variant}"] = (axon_cmd, extra, first)
    engines.update(peer_engines(llama_python, job, args.peers))
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, (command, extra_env, engine_job) in engines.items():
            runs[name].append(run_worker(command, engine_job, extra_env))
            print(f"  {model.name} {name} #{repeat + 1}: {json.dumps(runs[name][-1])}", flush=True)
    return {
        "model": model.name,
        "file_bytes": model.stat().st_size,
        "read_bytes": bytes_read_per_token(model),
        **{name: best(r) for name, r in runs.items()},
    }


def bytes_read_per_token(model: Path) -> int:
    """Weight bytes a decode step reads: every tensor, except an untied input embedding (one row
    is gathered per token; a tied one is read whole as the LM head)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(model)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


BUSY_LOOP = """import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
parent = os.getppid()
while os.getppid() == parent:  # a pure spin; it ends with the benchmark, however that ends
    for _ in range(1_000_000):
        pass
"""


@contextlib.contextmanager
def busy_core(cpu: int | None):
    """A process spinning on `cpu` (pinned: it never moves to another core) while the block
    runs; nothing when `cpu` is None."""
    if cpu is None:
        yield
        return
    load = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cpu)])
    print(f"busy core: pid {load.pid} spinning on CPU {cpu}", flush=True)
    try:
        yield
    finally:
        load.kill()
        load.wait()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="GGUF file(s) (default: the demo)")
    parser.add_argument("--qwen3", action="store_true", help="also the Qwen3-shaped Q8_0/Q4_K")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--stream-prompt-len", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--kv-bytes", type=int, default=256 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llamacpp-venv", type=Path, default=CACHE / "llamacpp-venv")
    parser.add_argument(
        "--prefill-only",
        action="store_true",
        help="measure prefill (and memory) only: decode and streams shrink to a token or two",
    )
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="measure batch-1 decode (and memory) only: prefill and streams shrink to a token",
    )
    parser.add_argument(
        "--busy-core",
        type=int,
        nargs="?",
        const=1,
        metavar="CPU",
        help="keep CPU (default 1) busy with a pinned spinning process during the measurements",
    )
    parser.add_argument(
        "--axon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more axon, run with this environment (thread-policy experiments); repeatable",
    )
    parser.add_argument(
        "--activation-precision",
        nargs="+",
        choices=["float32", "int8"],
        default=["float32"],
        help="axon's activation precision(s): one axon per value, in the same run",
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=PEER_NAMES,
        default=list(PEER_NAMES),
        help="the engines axon is compared with (ik_llama.cpp: built on first use)",
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def models(args: argparse.Namespace, llama_python: Path | None) -> list[Path]:
    if args.model:
        paths = [Path(m) for m in args.model]
    else:
        from axon.demo import demo_model_path

        paths = [demo_model_path()]
    if args.qwen3:
        from qwen3_gguf import write_qwen3_f16

        if llama_python is None:  # its quantizer makes the Q8_0 / Q4_K_M files
            llama_python = ensure_llamacpp(args.llamacpp_venv)
        f16 = write_qwen3_f16(CACHE / "qwen3-1024x8-f16.gguf")
        for ftype in ("Q8_0", "Q4_K_M"):
            paths.append(quantize(llama_python, f16, CACHE / f"qwen3-1024x8-{ftype}.gguf", ftype))
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prefill_only:  # the decode and stream columns are then meaningless; kept cheap
        args.decode_prompt_len, args.decode_tokens = 8, 2
        args.streams, args.stream_prompt_len, args.stream_tokens = [1], 8, 2
    if args.decode_only:  # the prefill and stream columns are then meaningless; kept cheap
        args.prefill_len = 8
        args.streams, args.stream_prompt_len, args.stream_tokens = [1], 8, 2
    if args.worker:
        print(json.dumps(axon_worker(json.load(sys.stdin))))
        return 0
    sys.path.insert(0, str(BENCH))
    llama_python = ensure_llamacpp(args.llamacpp_venv) if "llama.cpp" in args.peers else None
    with busy_core(args.busy_core):
        results = [compare(model, llama_python, args) for model in models(args, llama_python)]
    print(table(results, args.threads, args.peers))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
