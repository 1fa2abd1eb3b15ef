"""The table of benchmarks/gguf_vs_llamacpp.py: one row per engine and model, then per axon
variant and peer the ratio row (axon / peer), llama.cpp's with its targets."""

from __future__ import annotations

TARGET_DECODE, TARGET_16_STREAMS = 1.0, 2.0  # against llama.cpp
TARGET_PEER = "llama.cpp"


def table(results: list[dict], threads: int, peers: list[str]) -> str:
    streams = sorted({int(n) for r in results for n in r[axon_names(r)[0]]["streams_tok_s"]})
    lines = [
        "| model | engine | RSS after load (MiB) | prefill tok/s | batch-1 decode tok/s (GB/s) | "
        + "".join(f"{n} streams tok/s | " for n in streams)
        + f" ({threads} threads)",
        "| --- " * (5 + len(streams)) + "|",
    ]
    for r in results:
        present = [peer for peer in peers if peer in r]
        for name in axon_names(r) + present:
            m = r[name]
            gbs = m["decode_tok_s"] * r["read_bytes"] / 1e9
            s = m["streams_tok_s"]
            lines.append(
                f"| {r['model']} | {name} | {m['rss_bytes'] / 2**20:.0f} | "
                f"{m['prefill_tok_s']:.0f} | {m['decode_tok_s']:.1f} ({gbs:.1f}) | "
                + "".join(f"{s.get(str(n), 0):.1f} | " for n in streams)
            )
        for peer in present:
            lines.extend(ratio_row(r, name, peer, streams) for name in axon_names(r))
    return "\n".join(lines)


def axon_names(result: dict) -> list[str]:
    """axon, then its precision and --axon-env variants."""
    return [k for k in result if k.startswith("axon")]


def ratio_row(r: dict, name: str, peer: str, streams: list[int]) -> str:
    a, b = r[name], r[peer]
    targets = peer == TARGET_PEER
    ratios = []
    for n in streams:
        ratio = a["streams_tok_s"][str(n)] / b["streams_tok_s"][str(n)]
        marked = n == 16 and targets
        ratios.append(
            f"**{ratio:.2f}** (target {TARGET_16_STREAMS}) | " if marked else f"{ratio:.2f} | "
        )
    decode = f"**{a['decode_tok_s'] / b['decode_tok_s']:.2f}**"
    return (
        f"| {r['model']} | **{name} / {peer}** | {a['rss_bytes'] / b['rss_bytes']:.2f} | "
        f"{a['prefill_tok_s'] / b['prefill_tok_s']:.2f} | "
        + (f"{decode} (target {TARGET_DECODE}) | " if targets else f"{decode} | ")
        + "".join(ratios)
    )
