"""Long contexts, served: axon against llama.cpp's `llama-server` and ik_llama.cpp's server on the
same GGUF file with the same KV cache type, in one run (issue 35 point 2).

Rows, for each --lengths N (tokens):
- prefill: tokens/s of one fresh N-token prompt alone (N / TTFT);
- decode at N, batch 1: 1 / ITL p50 of the --output-len tokens that request then generates;
- decode at N, 4 streams (--streams; lengths in --stream-lengths): 4 fresh N-token prompts sent
  at once; the ITLs of the tokens that arrive after every stream's first token (all four
  decoding, no prefill in the step), streams / their median.
Every prompt is fresh random text (words through axon's /tokenize, token ids sent to every
server), so no prefix or prompt cache reuses anything; axon also runs with its prefix cache off.

Servers (all up for the whole run, each row measured on one engine after the other, the order
rotated each row, so a busy neighbour slows them alike), --threads threads each, --streams slots
of max(lengths) + output + 64 tokens: axon `--kv-cache-dtype float16|q8_0`; llama-server as
benchmarks/llama_server.py starts it, plus `-ctk/-ctv q8_0 -fa on` for --cache-type q8_0 (its
quantized V cache needs flash attention; the f16 run keeps its default, `-fa auto`);
ik_llama.cpp with `-rtr`, `-no-fa` above one slot (benchmarks/ik_llama.py) and
`-ctk/-ctv q8_0 -fa on` for q8_0 (its q8_0 V cache needs flash attention: at 4 slots the q8_0
run has it where the f16 run does not).

Files: the demo gemma-3-270m (32k context; 15 of its 18 layers slide over 512 tokens) by
default, `--model chat-demo` for SmolLM2-135M (trained context 8,192: lengths above it are left
out with a note, as both peers would run it past its RoPE range), `--model qwen3-q8_0` /
`qwen3-q4_k_m` for benchmarks/qwen3_gguf.py's files (made once, as
serve_vs_llama_server.py makes them), or a path.

    PYTHONPATH=src python benchmarks/long_context.py                       # f16, 4k/16k/32k
    PYTHONPATH=src python benchmarks/long_context.py --cache-type q8_0
    PYTHONPATH=src python benchmarks/long_context.py --lengths 4096 --peers llama-server

Prints the CPU, the load average and a markdown table with the ratios axon / llama.cpp and
axon / ik_llama.cpp (target: >= 1.2x llama.cpp on every row).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from llama_server import CACHE  # noqa: E402
from peers import PEERS, build_peers  # noqa: E402
from serve_vs_llama_server import (  # noqa: E402
    axon_command,
    free_port,
    launch,
    make_prompt_source,
    server_env,
)

AXON_CACHE = {"f16": "float16", "q8_0": "q8_0"}
NAMED_FILES = ("demo", "chat-demo", "qwen3-q8_0", "qwen3-q4_k_m")


# ---- pure logic -----------------------------------------------------------------------------


def arrivals(ttft: float, itl: list[float]) -> list[float]:
    """Seconds from the send of each output chunk after the first."""
    times, at = [], ttft
    for gap in itl:
        at += gap
        times.append(at)
    return times


def all_decoding_itls(results: list) -> list[float]:
    """The gaps of the chunks that arrived once every stream had its first token (all sent at
    once): steps in which every stream decodes and none prefills."""
    start = max(r.ttft for r in results)
    gaps = []
    for r in results:
        for gap, at in zip(r.itl, arrivals(r.ttft, r.itl), strict=True):
            if at - gap >= start:
                gaps.append(gap)
    return gaps


def usable_lengths(lengths: list[int], trained: int | None) -> tuple[list[int], list[str]]:
    """(lengths within the file's trained context, notes on those left out)."""
    if trained is None:
        return lengths, []
    kept = [n for n in lengths if n <= trained]
    notes = [f"{n} left out: past the file's trained context of {trained}" for n in lengths]
    return kept, [note for n, note in zip(lengths, notes, strict=True) if n > trained]


def ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    return f"**{ours / theirs:.2f}x**" if ours / theirs >= 1.2 else f"{ours / theirs:.2f}x"


def format_table(rows: dict, engines: list[str]) -> str:
    """rows {label: {engine: tokens/s}} -> markdown, with axon's ratios to each peer."""
    peers = [e for e in engines if e != "axon"]
    head = ["row", *(f"{e} tok/s" for e in engines), *(f"axon / {e}" for e in peers)]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for label, values in rows.items():
        cells = [f"{values[e]:,.1f}" if values.get(e) else "-" for e in engines]
        cells += [ratio(values.get("axon"), values.get(p)) for p in peers]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


# ---- servers --------------------------------------------------------------------------------


def peer_command(peer: str, binary: Path, model: Path, port: int, args) -> list[str]:
    command = PEERS[peer].command(
        binary, model, port, args.ctx_per_slot, args.streams, args.threads
    )
    if args.cache_type == "q8_0":  # a quantized V cache needs flash attention in both
        command = [c for c in command if c != "-no-fa"] + ["-ctk", "q8_0", "-ctv", "q8_0"]
        command += ["-fa", "on"]
    return command


def stop_servers(servers: dict) -> None:
    for process, _ in servers.values():
        process.stop(grace_s=20)


def start_servers(model: Path, binaries: dict[str, Path], args, log_dir: Path) -> dict:
    """{engine: (process, url)}, all ready."""
    ports = {engine: free_port() for engine in ("axon", *binaries)}
    args.slots, args.axon_log_level = args.streams, "warning"
    commands = {
        "axon": axon_command(model, ports["axon"], args)
        + ["--kv-cache-dtype", AXON_CACHE[args.cache_type], "--no-enable-prefix-caching"]
    }
    for peer, binary in binaries.items():
        commands[peer] = peer_command(peer, binary, model, ports[peer], args)
    logs = {engine: log_dir / f"{model.stem}-{engine}-long.log" for engine in commands}
    return launch(commands, ports, server_env(args.threads), logs, args.start_timeout)


# ---- the run --------------------------------------------------------------------------------


def send(url: str, name: str, prompts: list[list[int]], output_len: int) -> list:
    """All prompts at once; their RequestResults (raises on a failed or short one)."""
    from axon.bench.client import BenchPrompt, RequestConfig, run_level

    config = RequestConfig(url, "completions", name, temperature=0.0, ignore_eos=True)
    requests = [BenchPrompt(ids, len(ids), output_len) for ids in prompts]
    _, results = asyncio.run(run_level(config, {}, requests, len(requests), keep_alive=False))
    for r in results:
        if not r.success or r.output_tokens != output_len:
            raise RuntimeError(f"{name}: {r.output_tokens} of {output_len} tokens, {r.error}")
    return results


def measure(url: str, name: str, prompts: list[list[int]], output_len: int) -> dict:
    """{row kind: tokens/s}: one prompt -> prefill (N / TTFT) and batch-1 decode (1 / ITL p50);
    several at once -> their decode while all decode (streams / the ITL p50 of those steps)."""
    results = send(url, name, prompts, output_len)
    if len(prompts) == 1:
        (r,) = results
        return {"prefill": len(prompts[0]) / r.ttft, "decode": 1.0 / statistics.median(r.itl)}
    gaps = all_decoding_itls(results)
    return {"streams": len(results) / statistics.median(gaps) if gaps else None}


def row_labels(n: int, streams: int) -> dict:
    return {
        "prefill": f"prefill {n}",
        "decode": f"decode at {n}, batch 1",
        "streams": f"decode at {n}, {streams} streams",
    }


def run_rows(servers: dict, source, lengths: list[int], args, rows: dict, notes: list) -> None:
    """Fills rows {label: {engine: tok/s}} (kept as far as they got if the run is cut) and
    notes; every request its own fresh prompt; each measurement runs the engines in turn, the
    first one rotating. A peer whose request fails (ik_llama.cpp's flash attention asserts on
    some shapes) is left out of the later rows, with a note."""
    seed, engines = 0, list(servers)
    for n in lengths:
        labels = row_labels(n, args.streams)
        counts = [1] + ([args.streams] if args.streams > 1 and n in args.stream_lengths else [])
        for count in counts:
            for engine in list(engines):
                seed += 1
                try:
                    values = measure(
                        servers[engine][1], engine, source(count, n, seed), args.output_len
                    )
                except RuntimeError as exc:
                    if engine == "axon":
                        raise
                    notes.append(f"{engine} left out from {n} tokens x {count}: {exc}")
                    print(f"  {notes[-1]}", flush=True)
                    engines.remove(engine)
                    continue
                for kind, value in values.items():
                    rows.setdefault(labels[kind], {})[engine] = value
                    print(f"  {labels[kind]}: {engine} {value or 0:,.1f} tok/s", flush=True)
            engines = engines[1:] + engines[:1]


def warm_up(servers: dict, source, args) -> None:
    """One short request each: first-request costs (allocation, repacking) stay out of the rows."""
    for engine, (_, url) in servers.items():
        send(url, engine, source(1, 256, 10_000), 4)


def trained_context(model: Path) -> int | None:
    import gguf

    reader = gguf.GGUFReader(str(model))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields.get(f"{arch}.context_length")
    return int(field.parts[-1][0]) if field else None


def model_path(name: str) -> Path:
    from axon.demo import chat_demo_model_path, demo_model_path

    if name == "demo":
        return demo_model_path()
    if name == "chat-demo":
        return chat_demo_model_path()
    if name.startswith("qwen3-"):
        from llama_server import requantize
        from qwen3_gguf import write_qwen3_f16

        f16 = write_qwen3_f16(CACHE / "qwen3-1024x8-f16.gguf")
        kind = name.split("-", 1)[1].upper()
        return requantize(f16, kind, CACHE / f"qwen3-1024x8-{kind}.gguf")
    return Path(name)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="demo", help=f"{', '.join(NAMED_FILES)} or a GGUF path")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--cache-type", choices=sorted(AXON_CACHE), default="f16")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    p.add_argument(
        "--streams", type=int, default=4, help="the batched decode rows' streams (1: none)"
    )
    p.add_argument(
        "--stream-lengths",
        type=int,
        nargs="*",
        help="the lengths with a batched decode row (default: all; each costs streams x N "
        "tokens of prefill per engine)",
    )
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--activation-precision", default="auto")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # a SIGTERM (timeout, ^C of a wrapper) unwinds through the finally that stops the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = model_path(args.model)
    trained = trained_context(model)
    lengths, notes = usable_lengths(sorted(args.lengths), trained)
    args.ctx_per_slot = max(lengths) + args.output_len + 64
    # a length of the whole trained context: its prompt is that less the output
    if trained is not None and args.ctx_per_slot > trained:
        lengths = [min(n, trained - args.output_len) for n in lengths]
        args.ctx_per_slot = trained
    if args.stream_lengths is None:
        args.stream_lengths = lengths
    args.stream_lengths = [min(n, args.ctx_per_slot - args.output_len) for n in args.stream_lengths]
    print(f"CPU: {cpu_name()}, {args.threads} threads; load average {os.getloadavg()[0]:.1f}")
    print(f"{model.name}, cache {args.cache_type}, lengths {lengths}", *notes, sep="\n", flush=True)
    binaries = build_peers(args.peers)
    log_dir = CACHE / "long-context-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = start_servers(model, binaries, args, log_dir)
    started, rows, failures = time.perf_counter(), {}, []
    try:
        source = make_prompt_source(servers["axon"][1], model)
        warm_up(servers, source, args)
        run_rows(servers, source, lengths, args, rows, failures)
    except SystemExit:
        failures.append("cut short (SIGTERM): the rows so far")
    finally:
        stop_servers(servers)
    print(
        f"\n{model.name}, cache {args.cache_type}, {time.perf_counter() - started:.0f} s, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(format_table(rows, list(servers)), *notes, *failures, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
