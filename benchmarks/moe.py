"""A random Qwen3-MoE-shaped model, axon against llama.cpp on the same GGUF files, same run.

The model has an A3B-like ratio of active to total parameters, sized for a 2-core, 24 GiB
machine: hidden 1024, 12 layers, 32 experts of width 768 with 4 chosen per token (an eighth of
the experts read per token, as Qwen3-30B-A3B's 8 of 128 is a sixteenth), 16 query / 4 KV heads
of 64, a 32k placeholder vocabulary (prompts are token ids) and an untied head. It is written as
F16 with gguf-py under llama.cpp's `qwen3moe` names and quantized by llama.cpp's own quantizer to
Q8_0 and Q4_K_M, into ~/.cache/axon-bench/.

For each file both engines run in fresh processes, alternating, best of --repeats (the workers
of benchmarks/gguf_vs_llamacpp.py): batch-1 decode tok/s ((N - 1) / (time(N) - time(1))) and
aggregate tok/s of 16 concurrent greedy streams. Bandwidth is batch-1 tok/s times the bytes one
decode step reads: every tensor but the input embedding (one row gathered) and, of each layer's
stacked experts, only the chosen `top_k / num_experts` share.

    PYTHONPATH=src python benchmarks/moe.py                  # Q8_0 and Q4_K_M
    PYTHONPATH=src python benchmarks/moe.py --ftype Q8_0 --repeats 1
    PYTHONPATH=src python benchmarks/moe.py --ftype Q4_K_M --decode-only \
        --activation-precision float32 int8     # exact and 8-bit activations, same run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from gguf_vs_llamacpp import CACHE, compare, ensure_llamacpp, quantize  # noqa: E402
from gguf_vs_llamacpp import parse_args as comparison_args  # noqa: E402
from inprocess_table import axon_names  # noqa: E402

SHAPE = dict(
    hidden=1024, layers=12, heads=16, kv_heads=4, head_dim=64, experts=32, top_k=4,
    expert_width=768, vocab=32768, context=4096,
)  # fmt: skip
TARGET_DECODE = 1.0
NAME = "qwen3moe-1024x12-e32k4"


def _metadata(writer, shape: dict) -> None:
    import gguf

    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_expert_count(shape["experts"])
    writer.add_expert_used_count(shape["top_k"])
    writer.add_expert_feed_forward_length(shape["expert_width"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = shape["vocab"]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab)])
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, vocab)])
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensors(shape: dict, rng: np.random.Generator):
    """(GGUF name, numpy array in PyTorch order): matrices F16, norms and router F32."""
    h, d, e, w = shape["hidden"], shape["head_dim"], shape["experts"], shape["expert_width"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d

    def matrix(*dims: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float16)

    def norm(size: int) -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(size, dtype=np.float32)

    yield "token_embd.weight", matrix(shape["vocab"], h, std=1.0)
    for i in range(shape["layers"]):
        yield f"blk.{i}.attn_norm.weight", norm(h)
        yield f"blk.{i}.attn_q.weight", matrix(q, h)
        yield f"blk.{i}.attn_k.weight", matrix(kv, h)
        yield f"blk.{i}.attn_v.weight", matrix(kv, h)
        yield f"blk.{i}.attn_output.weight", matrix(h, q)
        yield f"blk.{i}.attn_q_norm.weight", norm(d)
        yield f"blk.{i}.attn_k_norm.weight", norm(d)
        yield f"blk.{i}.ffn_norm.weight", norm(h)
        yield f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((e, h), dtype=np.float32)
        yield f"blk.{i}.ffn_gate_exps.weight", matrix(e, w, h)
        yield f"blk.{i}.ffn_up_exps.weight", matrix(e, w, h)
        yield f"blk.{i}.ffn_down_exps.weight", matrix(e, h, w)
    yield "output_norm.weight", norm(h)
    yield "output.weight", matrix(shape["vocab"], h)


def write_moe_f16(target: Path, shape: dict = SHAPE, seed: int = 0) -> Path:
    """Write (once) the random Qwen3-MoE model as an F16 `qwen3moe` GGUF at `target`."""
    if target.exists():
        return target
    import gguf

    print(f"writing {target} ...", flush=True)
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "qwen3moe")
    _metadata(writer, shape)
    for name, data in _tensors(shape, np.random.default_rng(seed)):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)
    return target


def active_bytes_per_token(model: Path) -> tuple[int, int]:
    """(bytes one decode step reads, bytes of the file's tensors): the input embedding is
    gathered (one row), and a layer's stacked experts are read `top_k / num_experts`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    experts = int(reader.fields["qwen3moe.expert_count"].contents())
    top_k = int(reader.fields["qwen3moe.expert_used_count"].contents())
    total = active = 0
    for tensor in reader.tensors:
        size = int(tensor.n_bytes)
        total += size
        if tensor.name == "token_embd.weight":
            continue
        active += size * top_k // experts if tensor.name.endswith("_exps.weight") else size
    return active, total


def table(results: list[dict], threads: int) -> str:
    counts = {max(r["llama.cpp"]["streams_tok_s"], key=int) for r in results}
    lines = [
        f"| model | file MiB (active MiB / token) | engine | batch-1 decode tok/s (GB/s on "
        f"active bytes) | {'/'.join(sorted(counts))} streams tok/s | ({threads} threads)",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        size = f"{r['file_bytes'] / 2**20:.0f} ({r['read_bytes'] / 2**20:.0f})"
        streams = max(r["llama.cpp"]["streams_tok_s"], key=int)  # "16" ("1": --decode-only)
        for name in [*axon_names(r), "llama.cpp"]:
            m = r[name]
            gbs = m["decode_tok_s"] * r["read_bytes"] / 1e9
            lines.append(
                f"| {r['model']} | {size} | {name} | {m['decode_tok_s']:.1f} ({gbs:.1f}) | "
                f"{m['streams_tok_s'][streams]:.1f} |"
            )
        b = r["llama.cpp"]
        for name in axon_names(r):  # each axon against llama.cpp
            a = r[name]
            decode = a["decode_tok_s"] / b["decode_tok_s"]
            ratio = a["streams_tok_s"][streams] / b["streams_tok_s"][streams]
            lines.append(
                f"| {r['model']} | | **{name} / llama.cpp** | **{decode:.2f}** (target "
                f"{TARGET_DECODE}) | {ratio:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ftype", nargs="+", default=["Q8_0", "Q4_K_M"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--llamacpp-venv", type=Path, default=CACHE / "llamacpp-venv")
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="batch-1 decode only: the 16-stream column shrinks to one stream of two tokens",
    )
    parser.add_argument(
        "--activation-precision",
        nargs="+",
        choices=["float32", "int8"],
        default=["float32"],
        help="axon's activation precision(s): one axon per value, in the same run",
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    llama_python = ensure_llamacpp(args.llamacpp_venv)
    f16 = write_moe_f16(CACHE / f"{NAME}-F16.gguf")
    job_args = comparison_args(
        ["--threads", str(args.threads), "--repeats", str(args.repeats), "--streams", "16"]
        + ["--decode-tokens", str(args.decode_tokens), "--prefill-len", "64"]
        + ["--stream-tokens", str(args.stream_tokens)]
        + ["--activation-precision", *args.activation_precision, "--peers", "llama.cpp"]
    )
    if args.decode_only:  # as gguf_vs_llamacpp's --decode-only: the other columns kept cheap
        job_args.prefill_len, job_args.streams = 8, [1]
        job_args.stream_prompt_len, job_args.stream_tokens = 8, 2
    results = []
    for ftype in args.ftype:
        model = quantize(llama_python, f16, CACHE / f"{NAME}-{ftype}.gguf", ftype)
        result = compare(model, llama_python, job_args)
        result["read_bytes"], result["file_bytes"] = active_bytes_per_token(model)
        results.append(result)
    print(table(results, args.threads))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
