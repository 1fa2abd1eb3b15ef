"""Qwen3.5 decode: axon vs transformers on the same random Qwen3.5-shaped model, in one run.

Measures batch-1 and 16-stream greedy decode tokens/s for both engines. The decode-only rate
is `streams * (N - 1) / (time(N new tokens) - time(1 new token))`, so prefill and the first
token are subtracted out. Runs alternate axon / transformers and the fastest of `--repeats`
counts, because the machine may be shared.

Next to the rates it prints the bytes one decode step must read (the roofline): the weights
once per step (the embedding table excepted: a step reads one row per stream), plus per stream
the Gated DeltaNet states (read and written: conv + fp32 recurrent state per GDN layer) and the
full-attention layers' K/V over the context. `achieved GB/s = bytes per step * steps/s`.

    PYTHONPATH=src python benchmarks/qwen3_5_decode.py              # CPU-sized model
    PYTHONPATH=src python benchmarks/qwen3_5_decode.py --preset 0.8b --device cuda

Nothing is downloaded: the model is random (fixed seed), written by transformers to
~/.cache/axon-bench/qwen3_5-<preset> and reused.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch

# Both keep Qwen3.5's structure: 3 GDN layers to 1 gated-attention layer, 256-dim attention
# heads with 25% rotary, 128-dim GDN heads with twice as many value heads as key heads.
PRESETS = {
    "cpu": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=32768,
    ),
    "0.8b": dict(  # roughly Qwen3.5-0.8B's text shape (for a GPU run)
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=248320,
    ),
}
# Qwen3.5-0.8B's layers, 4 of them on the real schedule (linear x3, full): a CPU-sized cut
PRESETS["0.8b-4layers"] = {**PRESETS["0.8b"], "num_hidden_layers": 4}


def ensure_model(preset: str, seed: int = 0) -> Path:
    model_dir = Path.home() / ".cache" / "axon-bench" / f"qwen3_5-{preset}"
    if (model_dir / "config.json").exists():
        return model_dir
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        **PRESETS[preset], max_position_embeddings=4096, tie_word_embeddings=True
    )
    model = Qwen3_5ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(model_dir)
    del model
    gc.collect()
    return model_dir


def roofline_bytes(config, dtype: torch.dtype, streams: int, context: int) -> int:
    """Bytes one decode step reads: weights (minus the embedding table) + per-stream state and
    K/V."""
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if config.tie_word_embeddings:
        weights += config.vocab_size * config.hidden_size  # the LM head reads the table
    item = dtype.itemsize
    num_gdn = config.layer_types.count("linear_attention")
    num_full = config.num_hidden_layers - num_gdn
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim += config.linear_num_value_heads * config.linear_value_head_dim
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim
    recurrent *= config.linear_value_head_dim
    state = num_gdn * (conv_dim * (config.linear_conv_kernel_dim - 1) * item + recurrent * 4)
    kv = 2 * num_full * config.num_key_value_heads * config.head_dim * item * context
    return weights * item + streams * (2 * state + kv)


# ---- the two engines --------------------------------------------------------------------------


def axon_runner(model_dir: Path, device: str, dtype: str):
    from axon import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir), dtype=dtype, device=device, max_model_len=1024, max_num_seqs=16,
        enable_prefix_caching=False, kv_cache_memory=512 << 20,
    )  # fmt: skip

    def run(prompts: list[list[int]], new_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        _sync(device)
        return time.perf_counter() - start

    return run


def hf_runner(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def run(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        _sync(device)
        return time.perf_counter() - start

    return run, model.config


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_rate(run, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s over all streams, prefill and first token subtracted."""
    first = run(prompts, 1)
    full = run(prompts, new_tokens)
    return len(prompts) * (new_tokens - 1) / max(full - first, 1e-9)


# ---- the run ----------------------------------------------------------------------------------


def measure(args) -> list[dict]:
    model_dir = ensure_model(args.preset)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    axon = axon_runner(model_dir, args.device, args.dtype)
    hf, config = hf_runner(model_dir, args.device, torch_dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for streams in (1, 16):
        prompts = torch.randint(10, 30000, (streams, args.prompt_len), generator=gen).tolist()
        rates = {"axon": [], "transformers": []}
        decode_rate(axon, prompts, 4)  # warm-up
        decode_rate(hf, prompts, 4)
        for _ in range(args.repeats):
            rates["axon"].append(decode_rate(axon, prompts, args.new_tokens))
            rates["transformers"].append(decode_rate(hf, prompts, args.new_tokens))
        context = args.prompt_len + args.new_tokens // 2
        step_bytes = roofline_bytes(config, torch_dtype, streams, context)
        for engine, values in rates.items():
            best = max(values)
            rows.append(
                dict(engine=engine, streams=streams, tok_s=best, step_bytes=step_bytes,
                     gb_s=step_bytes * best / streams / 1e9)
            )  # fmt: skip
    return rows


def print_table(rows: list[dict], args) -> None:
    print(
        f"\nQwen3.5 decode, preset {args.preset}, {args.dtype}, {args.device}, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, best of {args.repeats}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| streams | engine | decode tok/s | vs transformers | MB per step | achieved GB/s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        peer = next(
            r for r in rows if r["streams"] == row["streams"] and r["engine"] == "transformers"
        )
        print(
            f"| {row['streams']} | {row['engine']} | {row['tok_s']:.1f} | "
            f"{row['tok_s'] / peer['tok_s']:.2f}x | {row['step_bytes'] / 1e6:.1f} | "
            f"{row['gb_s']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 0)))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
