"""A step's updates across the engine pipe: the typed messages (axon.engine.messages) against
the positional tuples they replaced, in the same run.

For 1 and 16 sequences, without logprobs and with the top 5 and 20, times encode (the engine:
a step's TokenUpdates to the bytes of one frame) and decode (the HTTP process: the frame back to
TokenUpdates with WireLogprobs), in microseconds, the best of several alternating rounds, and
prints each typed cost as a ratio of the tuples'.

    .venv/bin/python benchmarks/engine_messages.py [--rounds 25] [--number 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import pickle
import random
import time

from axon.engine.messages import Updates, WireLogprobs, decode, encode
from axon.outputs import TokenUpdate
from axon.sampling import TokenLogprobs

VOCAB = 151_936

# ---- the tuples: ("updates", [fields of each update, logprobs as a plain tuple]) ------------


@dataclasses.dataclass
class DataclassTokenUpdate:
    """TokenUpdate as it was with the tuples: a dataclass."""

    request_id: str
    index: int
    token_id: int | None
    logprobs: object | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None


_FIELDS = [field.name for field in dataclasses.fields(DataclassTokenUpdate)]
_fields = operator.attrgetter(*_FIELDS)
_LOGPROBS = _FIELDS.index("logprobs")


def _wire_update(update: DataclassTokenUpdate) -> tuple:
    fields = _fields(update)
    lp = update.logprobs
    if lp is None:
        return fields
    plain = (lp.token_id, lp.logprob, lp.rank, lp.top)
    return (*fields[:_LOGPROBS], plain, *fields[_LOGPROBS + 1 :])


def tuple_encode(updates: list[DataclassTokenUpdate]) -> bytes:
    message = ("updates", [_wire_update(update) for update in updates])
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def tuple_decode(data: bytes) -> list[DataclassTokenUpdate]:
    message = pickle.loads(data)
    updates = []
    if message[0] == "updates":
        for fields in message[1]:
            update = DataclassTokenUpdate(*fields)
            if update.logprobs is not None:
                update.logprobs = WireLogprobs(*update.logprobs)
            updates.append(update)
    return updates


# ---- the typed messages ---------------------------------------------------------------------


def typed_encode(updates: list[TokenUpdate]) -> bytes:
    return encode(Updates(updates))


def typed_decode(data: bytes) -> list[TokenUpdate]:
    message = decode(data)
    match message:
        case Updates():
            return message.updates
    return []


# ---- the run --------------------------------------------------------------------------------


def step_updates(num_seqs: int, top: int | None, rng: random.Random) -> list[TokenUpdate]:
    """One decode step's updates as the engine makes them (32-hex request ids, as served)."""
    updates = []
    for _ in range(num_seqs):
        token_id = rng.randrange(VOCAB)
        logprobs = None
        if top is not None:
            ranked = [(rng.randrange(VOCAB), -rng.random() * 10) for _ in range(top)]
            logprobs = TokenLogprobs(token_id, -rng.random(), 1 + rng.randrange(3), ranked)
        request_id = f"{rng.getrandbits(128):032x}"
        updates.append(TokenUpdate(request_id, 0, token_id, logprobs, num_cached_tokens=16))
    return updates


def best_us(fn, arg, number: int, rounds: list[float]) -> None:
    start = time.thread_time()
    for _ in range(number):
        fn(arg)
    rounds.append((time.thread_time() - start) / number * 1e6)


def measure(updates: list[TokenUpdate], rounds: int, number: int) -> dict[str, float]:
    """Best-of-`rounds` microseconds per call of each codec's encode and decode (CPU time of
    this thread: a busy machine distorts it less), the codecs alternating within each round."""
    old_updates = [DataclassTokenUpdate(*update) for update in updates]
    old_bytes, new_bytes = tuple_encode(old_updates), typed_encode(updates)
    old_rows = [_fields(update) for update in tuple_decode(old_bytes)]
    assert [tuple(update) for update in typed_decode(new_bytes)] == old_rows
    times: dict[str, list[float]] = {key: [] for key in ("te", "td", "ne", "nd")}
    for _ in range(rounds):
        best_us(tuple_encode, old_updates, number, times["te"])
        best_us(typed_encode, updates, number, times["ne"])
        best_us(tuple_decode, old_bytes, number, times["td"])
        best_us(typed_decode, new_bytes, number, times["nd"])
    best = {key: min(values) for key, values in times.items()}
    best["old_bytes"], best["new_bytes"] = len(old_bytes), len(new_bytes)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--number", type=int, default=2000, help="calls per round")
    args = parser.parse_args()
    rng = random.Random(0)
    print(
        "| seqs | logprobs | bytes tuple / typed | encode us tuple / typed | decode us tuple / "
        "typed | total us tuple / typed | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for num_seqs in (1, 16):
        for top in (None, 5, 20):
            updates = step_updates(num_seqs, top, rng)
            number = max(args.number // num_seqs, 50)
            t = measure(updates, args.rounds, number)
            old, new = t["te"] + t["td"], t["ne"] + t["nd"]
            print(
                f"| {num_seqs} | {'-' if top is None else f'top {top}'} "
                f"| {t['old_bytes']} / {t['new_bytes']} "
                f"| {t['te']:.2f} / {t['ne']:.2f} | {t['td']:.2f} / {t['nd']:.2f} "
                f"| {old:.2f} / {new:.2f} | {new / old:.2f}x |"
            )


if __name__ == "__main__":
    main()
