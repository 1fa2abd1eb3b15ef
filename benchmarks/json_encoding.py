"""A big chat answer's JSON encoding: the HTTP process's encoder before (FastAPI's
`jsonable_encoder`, then Starlette's `json.dumps`) against orjson, whole and one choice at a time
(axon.server.offload.encode_json, which lets the event loop run between choices).

The body is shaped like the answer to `n: 128, max_tokens: 300, logprobs: true, top_logprobs:
20` (about 55 MB). Prints the best of `--rounds` timings per encoder, its ratio to the old
path's, and checks that every encoder's bytes decode to the same object.

    .venv/bin/python benchmarks/json_encoding.py [--n 128] [--tokens 300] [--top 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import orjson
from fastapi.encoders import jsonable_encoder

from axon.server.offload import encode_json


def _entry(rng: random.Random, top: int) -> dict:
    def token() -> dict:
        text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 6)))
        return {"token": text, "logprob": rng.uniform(-20, 0), "bytes": list(text.encode())}

    return {**token(), "top_logprobs": [token() for _ in range(top)]}


def chat_body(n: int, tokens: int, top: int) -> dict:
    rng = random.Random(0)
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": "word " * tokens},
            "logprobs": {"content": [_entry(rng, top) for _ in range(tokens)]},
            "finish_reason": "length",
            "stop_reason": None,
        }
        for index in range(n)
    ]
    usage = {"prompt_tokens": 10, "completion_tokens": n * tokens, "total_tokens": 10 + n * tokens}
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": choices,
        "usage": usage,
    }


def starlette_path(body: dict) -> bytes:
    """What a route returning a dict cost: FastAPI's encoder, then JSONResponse.render."""
    content = jsonable_encoder(body)
    compact = (",", ":")
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=compact).encode()


ENCODERS = {
    "jsonable_encoder + json.dumps": starlette_path,
    "json.dumps": lambda body: json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
    "orjson.dumps (whole)": orjson.dumps,
    "encode_json (orjson per choice)": encode_json,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    body = chat_body(ns.n, ns.tokens, ns.top)
    reference = json.loads(starlette_path(body))
    best = {}
    for name, encode in ENCODERS.items():
        times = []
        for _ in range(ns.rounds):
            started = time.perf_counter()
            data = encode(body)
            times.append(time.perf_counter() - started)
        assert json.loads(data) == reference, name  # the same JSON, floats included
        best[name] = (min(times), len(data))
    base = best["jsonable_encoder + json.dumps"][0]
    print(f"{'encoder':34} {'best s':>8} {'MB':>7} {'x faster':>9}")
    for name, (seconds, size) in best.items():
        print(f"{name:34} {seconds:8.3f} {size / 1e6:7.1f} {base / seconds:9.1f}")


if __name__ == "__main__":
    main()
