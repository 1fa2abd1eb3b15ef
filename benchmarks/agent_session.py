"""A coding agent's session replayed against `axon serve` and `llama-server` on the same GGUF:
per-turn TTFT and the session's total time, then the same session after a restart of each server.

The session is Claude-Code-shaped and fully deterministic (no downloads): a system prompt of
about --system-tokens tokens (instructions plus ten tool schemas with long descriptions), a user
task, then --turns turns, each adding an assistant message with a tool call and the tool's result
(source files, grep hits, command output: 500-2,000 tokens each). Every turn is one streamed
`/v1/chat/completions` request carrying `tools`, the whole history, temperature 0 and a short
answer (--max-tokens); the answer is not added to the history (the recorded session's next
assistant turn is), so each turn's rendered prompt is the previous one plus the new messages.

Both servers render with the same corpus template (Qwen2.5's, Hermes-style tool calls; the demo
GGUF carries none), which renders earlier turns identically each turn: each turn's prompt
extends the last one, and a prefix cache hits. What each server reports as cached is printed per
turn: axon's `usage.prompt_tokens_details.cached_tokens`, llama-server's `timings.cache_n`.

Servers: one sequence each, --threads threads, a context of --ctx tokens. llama-server keeps its
prompt cache on (its default), `--cache-reuse 256`, its default SWA context checkpoints (the
demo is Gemma 3, with sliding-window layers) and `--slot-save-path`. axon runs with
`--prefix-cache-dir` (a fresh directory).

Phases, each server in turn (the servers never run at once):
- cold: a fresh server runs the session (turn 1 prefills the whole system prompt);
- restart: the server is stopped and started again; axon finds the prefix in its directory,
  llama-server gets its slot back with `POST /slots/0?action=restore` of the file saved with
  `action=save` after the cold session (the restore's time is printed and added to its turn 1).

Targets (issue 35): warm turns (2 on) TTFT <= 0.5x llama-server's; after a restart, axon's
turn 1 TTFT <= 0.2x its cold turn 1.

    PYTHONPATH=src python benchmarks/agent_session.py                      # ~12k + 10 turns
    PYTHONPATH=src python benchmarks/agent_session.py --system-tokens 3000 --turns 4  # quick
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from agent_session_text import session_messages, tool_schemas  # noqa: E402
from llama_server import (  # noqa: E402
    CACHE,
    build_llama_server,
    extract_sources,
    find_sdist,
    sdist_version,
)
from serve_vs_llama_server import (  # noqa: E402
    free_port,
    launch,
    server_env,
)

TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"


def template_path() -> Path:
    """The corpus template, from llama-server's extracted sources (extracted once)."""
    sdist = find_sdist()
    source = extract_sources(sdist, CACHE / f"llama-server-src-{sdist_version(sdist)}")
    return source / "models" / "templates" / TEMPLATE


# ---- servers --------------------------------------------------------------------------------


def axon_command(model: Path, port: int, args, cache_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "axon", "serve", str(model), "--port", str(port)]
    command += ["--served-model-name", "axon", "--max-num-seqs", "1"]
    command += ["--max-model-len", str(args.ctx), "--chat-template", str(template_path())]
    command += ["--prefix-cache-dir", str(cache_dir), "--log-level", "warning"]
    return command + list(args.axon_arg)


def llama_command(binary: Path, model: Path, port: int, args, slot_dir: Path) -> list[str]:
    return [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-c", str(args.ctx), "-np", "1", "-t", str(args.threads), "-tb", str(args.threads)),
        *("--jinja", "--chat-template-file", str(template_path())),
        *("--cache-reuse", "256", "--slot-save-path", str(slot_dir)),
        *("--timeout", "7200"),  # its default 600 s cut a busy machine's 12k-token first turn
        *("--no-webui", "--alias", "llama-server"),
        *args.llama_arg,
    ]


def start(engine: str, command: list[str], port: int, log: Path, args):
    """(ServerProcess, base url) of one server, ready."""
    env = server_env(args.threads)
    return launch({engine: command}, {engine: port}, env, {engine: log}, args.start_timeout)[engine]


# ---- one turn, one session ------------------------------------------------------------------


def turn(client: httpx.Client, url: str, model: str, messages, tools, max_tokens: int) -> dict:
    """One streamed request: TTFT (first chunk carrying output, or the finish), total seconds,
    prompt tokens and cached tokens as the server reports them."""
    body = {
        "model": model,
        "messages": messages,
        "tools": tools,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    row = {"prompt_tokens": None, "cached": None}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                output = delta.get("content") or delta.get("tool_calls")
                if ttft is None and (output or choice.get("finish_reason")):
                    ttft = time.perf_counter() - started
            read_counts(chunk, row)
    row.update(ttft=ttft, total=time.perf_counter() - started)
    return row


def read_counts(chunk: dict, row: dict) -> None:
    """Prompt and cached token counts: OpenAI usage (axon) or llama-server's timings."""
    usage = chunk.get("usage")
    if usage:
        row["prompt_tokens"] = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None or row["cached"] is None:
            row["cached"] = details.get("cached_tokens", 0)
    timings = chunk.get("timings")
    if timings and "cache_n" in timings:
        row["cached"] = timings["cache_n"]
        row["prompt_tokens"] = timings["cache_n"] + timings.get("prompt_n", 0)


def run_session(url: str, model: str, session: list, tools, args, label: str) -> list[dict]:
    rows = []
    # A connection per turn: llama-server closes a kept-alive connection after a streamed answer,
    # and the next turn sent on it fails with "Server disconnected without sending a response".
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=3600, limits=no_reuse) as client:
        for index, messages in enumerate(session, start=1):
            row = turn(client, url, model, messages, tools, args.max_tokens)
            rows.append(row)
            print(
                f"    {label:22} turn {index:2d}: prompt {row['prompt_tokens']:6} cached "
                f"{row['cached']:6}  TTFT {row['ttft'] * 1e3:8.1f} ms  total "
                f"{row['total'] * 1e3:8.1f} ms",
                flush=True,
            )
    return rows


# ---- the phases -----------------------------------------------------------------------------


def axon_phases(model: Path, session, tools, args, work: Path) -> dict:
    cache_dir = work / "axon-prefix"
    results = {}
    for phase in ("cold", "restart"):
        port = free_port()
        command = axon_command(model, port, args, cache_dir)
        process, url = start("axon", command, port, args.log_dir / f"axon-{phase}.log", args)
        try:
            results[phase] = run_session(url, "axon", session, tools, args, f"axon {phase}")
        finally:
            process.stop(grace_s=60)  # SIGTERM: the disk tier's queue is written on the way out
    return results


def llama_phases(model: Path, session, tools, args, work: Path) -> dict:
    binary = build_llama_server()
    slot_dir = work / "llama-slots"
    slot_dir.mkdir()
    results = {}
    for phase in ("cold", "restart"):
        port = free_port()
        command = llama_command(binary, model, port, args, slot_dir)
        log = args.log_dir / f"llama-server-{phase}.log"
        process, url = start("llama-server", command, port, log, args)
        try:
            restore = slot_action(url, "restore") if phase == "restart" else 0.0
            rows = run_session(url, "llama-server", session, tools, args, f"llama-server {phase}")
            rows[0]["restore"] = restore
            if phase == "cold":
                slot_action(url, "save")
            results[phase] = rows
        finally:
            process.stop(grace_s=30)
    return results


def slot_action(url: str, action: str) -> float:
    """Save or restore slot 0 to / from the slot file; the seconds it took."""
    started = time.perf_counter()
    response = httpx.post(
        f"{url}/slots/0?action={action}", json={"filename": "agent-session.bin"}, timeout=600
    )
    seconds = time.perf_counter() - started
    print(
        f"    llama-server slot {action}: {response.status_code} in {seconds * 1e3:.0f} ms "
        f"{response.text[:160]}",
        flush=True,
    )
    return seconds if response.status_code == 200 else 0.0


# ---- the report -----------------------------------------------------------------------------


def summarize(results: dict) -> str:
    axon, llama = results["axon"], results["llama-server"]
    lines = [
        "| turn | prompt tok | axon cached | llama cached | axon TTFT ms | llama TTFT ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for index, (a, b) in enumerate(zip(axon["cold"], llama["cold"]), start=1):
        lines.append(
            f"| {index} | {a['prompt_tokens']} | {a['cached']} | {b['cached']} | "
            f"{a['ttft'] * 1e3:.0f} | {b['ttft'] * 1e3:.0f} | {a['ttft'] / b['ttft']:.2f}x |"
        )
    total = {name: sum(r["total"] for r in res["cold"]) for name, res in results.items()}
    warm = [a["ttft"] / b["ttft"] for a, b in zip(axon["cold"][1:], llama["cold"][1:])]
    a_restart, b_restart = axon["restart"][0], llama["restart"][0]
    restart_ratio = a_restart["ttft"] / axon["cold"][0]["ttft"]
    lines += [
        "",
        f"session total: axon {total['axon']:.2f} s, llama-server {total['llama-server']:.2f} s "
        f"({total['axon'] / total['llama-server']:.2f}x)",
        f"after a restart, turn 1: axon {a_restart['ttft'] * 1e3:.0f} ms (cached "
        f"{a_restart['cached']}), llama-server {b_restart['ttft'] * 1e3:.0f} ms + restore "
        f"{b_restart.get('restore', 0) * 1e3:.0f} ms (cached {b_restart['cached']})",
        "",
        f"target turns 2+ TTFT <= 0.5x llama-server: worst {max(warm):.2f}x, mean "
        f"{sum(warm) / len(warm):.2f}x: {'pass' if max(warm) <= 0.5 else 'MISS'}",
        f"target restart turn 1 <= 0.2x axon's cold turn 1: {restart_ratio:.2f}x: "
        f"{'pass' if restart_ratio <= 0.2 else 'MISS'}",
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="GGUF file (default: the demo)")
    parser.add_argument("--system-tokens", type=int, default=12000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--axon-arg", action="append", default=[], help="extra `axon serve` arg")
    parser.add_argument("--llama-arg", action="append", default=[], help="extra llama-server arg")
    parser.add_argument("--engines", nargs="+", default=["axon", "llama-server"])
    parser.add_argument("--json", type=Path, help="write every turn's figures here too")
    parser.add_argument("--log-dir", type=Path, default=CACHE / "agent-session-logs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from axon.demo import demo_model_path

    model = args.model or demo_model_path()
    rng = random.Random(args.seed)
    tools = tool_schemas(rng, args.system_tokens)
    session = session_messages(rng, args.turns, args.system_tokens)
    print(f"{model.name}: {args.turns} turns, ~{args.system_tokens} system tokens", flush=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="agent-session-") as tmp:
        for engine in args.engines:
            phases = axon_phases if engine == "axon" else llama_phases
            results[engine] = phases(model, session, tools, args, Path(tmp))
            if args.json:  # each engine's figures as soon as they are in
                args.json.write_text(json.dumps(results, indent=1))
    if set(results) == {"axon", "llama-server"}:
        print(summarize(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
