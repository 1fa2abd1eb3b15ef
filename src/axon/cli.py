"""The `axon` command line: `axon serve` (the HTTP daemon), `axon generate` and `axon chat` on
a local Hugging Face model directory, `axon bench serve` (the serving benchmark against any
OpenAI-compatible URL) and `axon tp-smoke` (a tensor-parallel group's sanity check).

Engine flags carry vLLM's names (`--max-model-len`, `--enable-prefix-caching`, ...). axon and torch
are imported inside the command functions only, so `axon --help` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from axon.settings import GENERATE, add_flags, select
from axon.settings import parse_size as parse_size  # the size grammar of --kv-cache-memory

DEFAULT_TEMPERATURE = 0.7
DEFAULT_MAX_TOKENS = 128
# The engine flags: the settings of axon/settings.py that `axon generate` and `axon chat` take,
# each filling the `LLM(...)` keyword argument of the same name.
_ENGINE_SETTINGS = select(GENERATE)


def _number_arg(kind: type, check: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
        return value

    return convert


_positive_int = _number_arg(int, lambda v: v >= 1, "must be an integer >= 1")
_non_negative_float = _number_arg(float, lambda v: v >= 0.0, "must be >= 0")
_unit_interval_float = _number_arg(float, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
_top_k_int = _number_arg(int, lambda v: v >= -1, "must be -1 or 0 (disabled) or >= 1")
_seed_int = _number_arg(int, lambda v: v >= 0, "must be an integer >= 0")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds the engine flags (vLLM's names) to `parser`; `engine_args_from_namespace` reads them."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=True, help="local Hugging Face model directory")
    add_flags(group, _ENGINE_SETTINGS, fill_defaults=True)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Adds the sampling flags to `parser`; `sampling_params_from_namespace` reads them."""
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=DEFAULT_TEMPERATURE,
        help=f"0 is greedy (default: {DEFAULT_TEMPERATURE})",
    )
    group.add_argument(
        "--top-p", type=_unit_interval_float, default=1.0, help="nucleus mass (default: 1.0)"
    )
    group.add_argument("--top-k", type=_top_k_int, default=0, help="0 or -1 disables (default: 0)")
    group.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"most tokens to generate per answer (default: {DEFAULT_MAX_TOKENS})",
    )
    group.add_argument("--seed", type=_seed_int, help="seed of the sampler, for repeatable output")


def build_parser() -> argparse.ArgumentParser:
    """Returns the `axon` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="axon", description="axon: LLM inference on PyTorch")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from axon.server.serve_args import add_serve_args  # lazy: the server stack loads in run_serve

    serve = commands.add_parser("serve", help="run the HTTP server (OpenAI API + node API)")
    add_serve_args(serve)
    serve.set_defaults(handler=_cmd_serve)

    generate = commands.add_parser("generate", help="complete one prompt, streaming the text")
    generate.add_argument("--prompt", required=True, help="text to complete (no chat template)")
    generate.set_defaults(handler=_cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", help="system message at the start of the conversation")
    chat.set_defaults(handler=_cmd_chat)

    for sub in (generate, chat):
        add_engine_args(sub)
        add_sampling_args(sub)
    _add_bench_command(commands)

    smoke = commands.add_parser(
        "tp-smoke", help="check tensor-parallel ranks: spawn, join, all-reduce, shut down"
    )
    smoke.add_argument("--tp-size", type=_positive_int, required=True, help="number of ranks")
    smoke.add_argument(
        "--devices", type=_device_list, help="GPU index of each rank, comma-separated: 0,1"
    )
    smoke.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="(default: auto)"
    )
    smoke.add_argument(
        "--timeout", type=_positive_int, default=60, help="seconds for the rendezvous (60)"
    )
    smoke.set_defaults(handler=_cmd_tp_smoke)
    return parser


def _device_list(text: str) -> list[int]:
    try:
        devices = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1, got {text!r}") from None
    if any(device < 0 for device in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"expected distinct GPU indices >= 0, got {text!r}")
    return devices


def engine_args_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """Returns the keyword arguments for `LLM(model=ns.model, **args)`.

    Flags left unset are left out, so the engine's own defaults apply to them.
    """
    values = {setting.name: getattr(ns, setting.name, None) for setting in _ENGINE_SETTINGS}
    return {name: value for name, value in values.items() if value is not None}


def sampling_kwargs_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    """Returns the keyword arguments for `SamplingParams(**kwargs)`."""
    return {
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "max_tokens": ns.max_tokens,
        "seed": ns.seed,
    }


def stream_to(deltas: Iterable[str], out: TextIO) -> str:
    """Writes each text delta to `out` as it arrives; returns the whole text.

    Closes the stream when done or interrupted, so the engine can drop an abandoned request.
    """
    pieces: list[str] = []
    try:
        for delta in deltas:
            pieces.append(delta)
            out.write(delta)
            out.flush()
    finally:
        close = getattr(deltas, "close", None)
        if close is not None:
            close()
    return "".join(pieces)


def run_generate(llm: Any, prompt: str, sampling_params: Any, out: TextIO) -> str:
    """Streams the completion of `prompt` to `out`, ending with a newline; returns its text."""
    text = stream_to(llm.stream(prompt, sampling_params), out)
    out.write("\n")
    out.flush()
    return text


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """Returns the engine prompt for `messages`: the chat template's text, as token ids.

    The template writes its own special tokens (a BOS among them), so the text is encoded
    without adding more.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def run_chat(
    llm: Any,
    sampling_params: Any,
    read_line: Callable[[str], str],
    out: TextIO,
    system: str | None = None,
) -> list[dict[str, str]]:
    """Runs the chat loop until `/exit` or end of input; returns the conversation at the end.

    `/reset` clears the conversation (the system message stays). Ctrl-C during an answer drops
    that answer and its question; Ctrl-C at the prompt quits.
    """
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    out.write("axon chat: /reset clears the conversation, /exit or Ctrl-D quits\n")
    while True:
        try:
            line = read_line(">>> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return messages
        command = line.strip()
        if command == "/exit":
            return messages
        if command == "/reset":
            messages = list(start)
            out.write("(conversation cleared)\n")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        prompt = render_chat_prompt(llm.tokenizer, messages)
        try:
            answer = stream_to(llm.stream(prompt, sampling_params), out)
        except KeyboardInterrupt:
            messages.pop()
            out.write("\n(interrupted)\n")
            continue
        out.write("\n")
        messages.append({"role": "assistant", "content": answer})


def _load(ns: argparse.Namespace) -> tuple[Any, Any]:
    """Returns (LLM, SamplingParams) built from the flags; the first import of torch is here."""
    if not Path(ns.model).exists():
        raise FileNotFoundError(f"--model {ns.model!r}: no such file or directory")
    from axon import LLM, SamplingParams  # lazy: the engine stack (torch)

    sampling_params = SamplingParams(**sampling_kwargs_from_namespace(ns))
    return LLM(model=ns.model, **engine_args_from_namespace(ns)), sampling_params


def _cmd_generate(ns: argparse.Namespace) -> int:
    llm, sampling_params = _load(ns)
    run_generate(llm, ns.prompt, sampling_params, sys.stdout)
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    llm, sampling_params = _load(ns)
    if getattr(llm.tokenizer, "chat_template", None) is None:
        raise ValueError(f"{ns.model} has no chat template; `axon generate` completes plain text")
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (gives input() line editing and history)
    run_chat(llm, sampling_params, input, sys.stdout, system=ns.system)
    return 0


def _cmd_tp_smoke(ns: argparse.Namespace) -> int:
    """Prints `status=ok tp_size=N devices=...`; a failure is `status=failed ... reason=...` on
    stderr and exit status 1."""
    from axon.distributed.smoke import run_smoke, smoke_devices  # lazy: torch

    devices = smoke_devices(ns.tp_size, ns.devices, ns.device)
    names = ",".join(str(d.index) if d.type == "cuda" else d.type for d in devices)
    try:
        run_smoke(ns.tp_size, devices, float(ns.timeout))
    except Exception as exc:  # noqa: BLE001 - the reason is the command's output
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        print(
            f"status=failed tp_size={ns.tp_size} devices={names} reason={reason}", file=sys.stderr
        )
        return 1
    print(f"status=ok tp_size={ns.tp_size} devices={names}")
    return 0


def _add_bench_command(commands: Any) -> None:
    """`axon bench serve`: the serving benchmark (axon.bench.serve) against any OpenAI URL."""
    from axon.bench.args import add_bench_serve_args  # lazy: argparse only, not the client

    bench = commands.add_parser("bench", help="benchmark a running server")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    serve = kinds.add_parser("serve", help="TTFT, TPOT, ITL, E2E and throughput (vLLM's)")
    add_bench_serve_args(serve)
    serve.set_defaults(handler=_cmd_bench_serve)


def _cmd_bench_serve(ns: argparse.Namespace) -> int:
    from axon.bench.serve import run_bench_serve  # lazy: the benchmark client (httpx)

    return run_bench_serve(ns)


def _cmd_serve(ns: argparse.Namespace) -> int:
    from axon.server.serve import run_serve  # lazy: the server stack, for serve only

    return run_serve(ns)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("axon")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Runs the `axon` command line; returns the process exit status."""
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"axon {ns.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
