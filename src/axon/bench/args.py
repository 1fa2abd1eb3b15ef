"""`axon bench serve`'s flags: argparse only, so building `axon --help` imports no HTTP client."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DESCRIPTION = (
    "The serving benchmark against any OpenAI-compatible server: TTFT, TPOT, ITL, E2E latency "
    "percentiles and throughput (vLLM's definitions) over a concurrency or request-rate sweep."
)
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_CONCURRENCY = (1, 4, 16)


def _list_of(kind: type, rule: str):
    def convert(text: str) -> list:
        try:
            values = [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}") from None
        if not values or any(not value > 0 for value in values):
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
        return values

    return convert


def _positive_int(text: str) -> int:
    return _list_of(int, "must be an integer >= 1")(text)[0]


def _percentile_list(text: str) -> list[float]:
    values = _list_of(float, "must be in (0, 100]")(text)
    if any(value > 100 for value in values):
        raise argparse.ArgumentTypeError(f"must be in (0, 100], got {text!r}")
    return values


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def _add_prompt_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument(
        "--dataset", type=Path, metavar="FILE", help='JSONL of {"prompt": ...}, or ShareGPT JSON'
    )
    group.add_argument(
        "--dataset-output-len",
        type=_positive_int,
        metavar="N",
        help="max_tokens of every dataset prompt (default: the record's output_len, or the "
        "ShareGPT reply's length)",
    )
    group.add_argument("--random-input-len", type=_positive_int, default=256, metavar="N")
    group.add_argument("--random-output-len", type=_positive_int, default=128, metavar="N")
    group.add_argument(
        "--random-range-ratio",
        type=_ratio,
        default=0.0,
        metavar="R",
        help="lengths uniform in [len * (1 - R), len * (1 + R)] (default: 0)",
    )
    group.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="counts prompt tokens (default: the server's /tokenize, else words)",
    )
    group.add_argument(
        "--num-prompts", type=_positive_int, default=32, metavar="N", help="per level (32)"
    )
    group.add_argument("--seed", type=int, default=0)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """Adds `axon bench serve`'s flags (vLLM's names where vLLM has the flag) to `parser`."""
    parser.description = DESCRIPTION
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=DEFAULT_BASE_URL, help="(default: %(default)s)")
    server.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    server.add_argument("--model", help="model id (default: the only one /v1/models lists)")
    server.add_argument(
        "--api-key", default=os.environ.get("AXON_API_KEY"), help="(default: $AXON_API_KEY)"
    )
    _add_prompt_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=_list_of(int, "must be integers >= 1"),
        metavar="C,C,...",
        help="levels of requests in flight (default: 1,4,16)",
    )
    load.add_argument(
        "--request-rate",
        type=_list_of(float, "must be > 0 (inf: all at once)"),
        metavar="R,R,...",
        help="levels of Poisson arrivals per second (inf: all at once)",
    )
    load.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests first (1)")
    load.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    output = parser.add_argument_group("results")
    output.add_argument(
        "--metric-percentiles", type=_percentile_list, metavar="Q,Q,...", help="(50,90,99)"
    )
    output.add_argument("--result-json", type=Path, metavar="FILE", help="write the results here")
    output.add_argument("--plot", type=Path, metavar="FILE.png", help="needs matplotlib")
    output.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
