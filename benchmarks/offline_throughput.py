"""Offline throughput: axon's `LLM.generate` against HF transformers, same weights, same run.

One run builds (or reuses) a Qwen3-shaped random model, then measures on the same machine:

1. axon: every request at once through `LLM.generate` (continuous batching) -> output tok/s;
2. transformers, one request at a time (`generate` per request, on a subset) -> output tok/s;
3. transformers, padded batches (left padding + attention mask; every row runs to its batch's
   longest output, only the requested tokens count) -> useful output tok/s;
4. batch-1 decode for both: one 128-token prompt, 128 new tokens; the decode-only rate is
   (128 - 1) tokens / (time(128 tokens) - time(1 token)), i.e. the prefill and first token are
   subtracted out. Achieved weight bandwidth is printed next to it.

It prints a markdown table with the ratios and the targets of the core-engine issue.

Both engines are loaded side by side and the measurements are interleaved, because the machine
may be shared: batch-1 runs alternate axon / transformers (the fastest of each counts), and the
throughput phases run as transformers per-request (first half of the subset), axon batched,
transformers padded, transformers per-request (second half). Each phase prints its wall time,
process CPU time and the 1-minute load average, so a reader can see how busy the machine was.

    PYTHONPATH=src python benchmarks/offline_throughput.py            # full run
    PYTHONPATH=src python benchmarks/offline_throughput.py --quick    # smoke run

Nothing is downloaded: the model is random (fixed seed) and written by transformers to
~/.cache/axon-bench/qwen3-1024x8 (or --model-dir), reused when present.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODEL_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=False,
)
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "axon-bench" / "qwen3-1024x8"

# Targets of the core-engine issue.
TARGET_VS_PER_REQUEST = 5.0
TARGET_VS_PADDED = 1.5
TARGET_DECODE = 1.0


# ---- model ----------------------------------------------------------------------------------


def ensure_model(model_dir: Path, seed: int) -> Path:
    """Write the random Qwen3 checkpoint with transformers once; reuse it afterwards."""
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(f"building random Qwen3 model in {model_dir} ...", flush=True)
    torch.manual_seed(seed)
    config = Qwen3Config(**MODEL_SHAPE, dtype="float32")
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    del model
    gc.collect()
    return model_dir


# ---- workload -------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        prompts.append([rng.randrange(vocab) for _ in range(plen)])
        outs.append(rng.randint(*output_range))
    return Workload(prompts, outs)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


# ---- axon -----------------------------------------------------------------------------------


def axon_params(max_tokens: int):
    from axon.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=0, ignore_eos=True)


def axon_generate(
    llm, prompts: list[list[int]], output_lens: list[int]
) -> tuple[float, list[list[int]]]:
    params = [axon_params(n) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outs]


def axon_one(llm, prompt: list[int], max_tokens: int) -> float:
    llm.engine.reset_prefix_cache()  # both runs must prefill the prompt in full
    elapsed, outs = axon_generate(llm, [prompt], [max_tokens])
    assert len(outs[0]) == max_tokens, (len(outs[0]), max_tokens)
    return elapsed


# ---- transformers ---------------------------------------------------------------------------


def hf_generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )
    return out[:, input_ids.shape[1] :]


def hf_one(model, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt], dtype=torch.long)
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_generate(model, ids, mask, new_tokens)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == new_tokens, (out.shape, new_tokens)
    return elapsed, out[0].tolist()


def hf_padded_batch(model, prompts: list[list[int]], output_lens: list[int]) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0, left padding
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    new_tokens = max(output_lens)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_generate(model, ids, mask, new_tokens)
    elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts), new_tokens), out.shape
    return elapsed


# ---- helpers --------------------------------------------------------------------------------


def decode_rate(t_one: float, t_full: float, new_tokens: int) -> float:
    """Tokens/s of tokens 2..new_tokens: the prefill + first token (t_one) subtracted."""
    return (new_tokens - 1) / max(t_full - t_one, 1e-9)


def weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes read per decode step, total parameter bytes) from the checkpoint's tensors.

    A decode step reads every matrix once, lm_head included; the input-embedding table is only
    gathered (one row per token), so it is left out of the bytes read per step."""
    from safetensors import safe_open

    total = embed = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(name)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                nbytes = numel * {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
                total += nbytes
                if name.endswith("embed_tokens.weight"):
                    embed += nbytes
    return total - embed, total


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


class Phase:
    """Times a phase and records the machine's load (the machine is shared, so say how busy)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0
        self.load = os.getloadavg()[0]
        return False

    def __str__(self) -> str:
        return f"[wall {self.wall:.1f}s, process CPU {self.cpu:.1f}s, 1-min load {self.load:.2f}]"


@dataclass
class Results:
    info: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument(
        "--hf-subset", type=int, default=8, help="requests timed one at a time in transformers"
    )
    p.add_argument(
        "--hf-batch", type=int, default=0, help="transformers padded batch size (0: all requests)"
    )
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument(
        "--decode-repeats",
        type=int,
        default=3,
        help="interleaved batch-1 rounds (axon 1, hf 1, axon N, hf N); the fastest run counts",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for both engines (default: torch's default, one per core)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--quick", action="store_true", help="small smoke run (8 requests, short lengths)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        args.prompt_len = (16, 64)
        args.output_len = (8, 16)
        args.hf_subset = min(args.hf_subset, 2)
        args.decode_prompt_len = 32
        args.decode_tokens = 16
        args.decode_repeats = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from transformers import Qwen3ForCausalLM

    from axon.engine.llm import LLM
    from axon.runner.memory import kv_bytes_per_token

    if args.threads:
        torch.set_num_threads(args.threads)
    res = Results()
    model_dir = ensure_model(args.model_dir.expanduser(), args.seed)
    read_bytes, total_bytes = weight_bytes(model_dir)
    vocab = MODEL_SHAPE["vocab_size"]
    work = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed
    )
    hf_batch = args.hf_batch or args.num_requests
    res.info = {
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}",
        "model": f"Qwen3 random, {MODEL_SHAPE}, fp32, {total_bytes / 1e9:.3f} GB params, "
        f"{read_bytes / 1e9:.3f} GB read per decode step",
        "workload": f"{args.num_requests} requests, "
        f"prompt {args.prompt_len[0]}-{args.prompt_len[1]} "
        f"(total {sum(map(len, work.prompts))} tokens), "
        f"output {args.output_len[0]}-{args.output_len[1]} "
        f"(total {work.num_output_tokens} tokens), greedy, ignore_eos, seed {args.seed}",
    }
    for k, v in res.info.items():
        print(f"{k}: {v}", flush=True)

    # -- engines: both loaded at once, so the measurements can be interleaved -----------------
    cfg = json.loads((model_dir / "config.json").read_text())
    max_model_len = max(
        args.prompt_len[1] + args.output_len[1], args.decode_prompt_len + args.decode_tokens
    )
    max_model_len = -(-max_model_len // 16) * 16
    per_token = kv_bytes_per_token(
        cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"], torch.float32
    )
    max_num_seqs = max(args.num_requests, 1)
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=max_num_seqs * max_model_len * per_token,  # room for every request at once
    )
    print(f"axon loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    t0 = time.perf_counter()
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print(
        f"transformers loaded in {time.perf_counter() - t0:.1f}s "
        f"(attn {hf.config._attn_implementation})",
        flush=True,
    )

    warm = make_workload(min(4, args.num_requests), (16, 48), (4, 8), vocab, args.seed + 1000)
    axon_generate(llm, warm.prompts, warm.output_lens)
    hf_one(hf, warm.prompts[0], 4)

    # -- batch-1 decode, interleaved: (axon 1, hf 1, axon N, hf N) per round; fastest counts ----
    N = args.decode_tokens
    dprompt = random_prompt(args.decode_prompt_len, vocab, args.seed + 2000)
    axon_one(llm, dprompt, 2)
    hf_one(hf, dprompt, 2)
    times = {"a1": [], "h1": [], "an": [], "hn": []}
    with Phase("batch-1 decode") as ph_decode:
        for _ in range(args.decode_repeats):
            times["a1"].append(axon_one(llm, dprompt, 1))
            times["h1"].append(hf_one(hf, dprompt, 1)[0])
            times["an"].append(axon_one(llm, dprompt, N))
            times["hn"].append(hf_one(hf, dprompt, N)[0])
    a1, h1, an, hn = (min(times[k]) for k in ("a1", "h1", "an", "hn"))
    axon_decode, hf_decode = decode_rate(a1, an, N), decode_rate(h1, hn, N)
    print(
        f"batch-1 decode: axon 1 token {a1:.3f}s, {N} tokens {an:.3f}s -> {axon_decode:.2f} tok/s; "
        f"transformers {h1:.3f}s / {hn:.3f}s -> {hf_decode:.2f} tok/s "
        f"(all runs: {json.dumps({k: [round(x, 3) for x in v] for k, v in times.items()})}) "
        f"{ph_decode}",
        flush=True,
    )

    # -- throughput: hf per-request (first half), axon batched, hf padded, hf per-request (rest) --
    subset = list(range(min(args.hf_subset, args.num_requests)))
    half = len(subset) // 2
    hf_seq = {}

    def run_hf_subset(model, indices: list[int]) -> None:
        for i in indices:
            hf_seq[i] = hf_one(model, work.prompts[i], work.output_lens[i])

    with Phase("hf per-request, first half") as ph_seq1:
        run_hf_subset(hf, subset[:half])
    print(f"transformers per-request: first {half} requests done {ph_seq1}", flush=True)

    llm.engine.reset_prefix_cache()
    preempt_before = llm.get_stats()["num_preemptions"]
    with Phase("axon batched") as ph_axon:
        t_axon, axon_tokens = axon_generate(llm, work.prompts, work.output_lens)
    assert [len(t) for t in axon_tokens] == work.output_lens
    axon_tps = work.num_output_tokens / t_axon
    preemptions = llm.get_stats()["num_preemptions"] - preempt_before
    print(
        f"axon batched: {work.num_output_tokens} tokens in {t_axon:.2f}s = {axon_tps:.1f} tok/s "
        f"({preemptions} preemptions) {ph_axon}",
        flush=True,
    )

    t_pad = 0.0
    computed = 0
    with Phase("hf padded") as ph_pad:
        for s in range(0, args.num_requests, hf_batch):
            prompts, outs = work.prompts[s : s + hf_batch], work.output_lens[s : s + hf_batch]
            t_pad += hf_padded_batch(hf, prompts, outs)
            computed += len(outs) * max(outs)
    hf_pad_tps = work.num_output_tokens / t_pad
    print(
        f"transformers padded (batch {hf_batch}): {work.num_output_tokens} useful of {computed} "
        f"generated "
        f"tokens in {t_pad:.2f}s = {hf_pad_tps:.1f} useful tok/s {ph_pad}",
        flush=True,
    )

    with Phase("hf per-request, second half") as ph_seq2:
        run_hf_subset(hf, subset[half:])
    t_sub = sum(hf_seq[i][0] for i in subset)
    agree = sum(hf_seq[i][1] == axon_tokens[i] for i in subset)
    sub_tokens = sum(work.output_lens[i] for i in subset)
    hf_seq_tps = sub_tokens / t_sub
    print(
        f"transformers per-request: {sub_tokens} tokens ({len(subset)} requests) in {t_sub:.2f}s = "
        f"{hf_seq_tps:.1f} tok/s; greedy outputs identical to axon: {agree}/{len(subset)} "
        f"{ph_seq2}",
        flush=True,
    )
    del llm, hf
    gc.collect()

    # -- report -------------------------------------------------------------------------------
    def met(ratio: float, target: float) -> str:
        return "yes" if ratio >= target else "**no**"

    r1, r2, r3 = axon_tps / hf_seq_tps, axon_tps / hf_pad_tps, axon_decode / hf_decode
    bw_axon, bw_hf = axon_decode * read_bytes / 1e9, hf_decode * read_bytes / 1e9
    n = args.num_requests
    # CPU time is less sensitive than wall time to other processes on a shared machine (a
    # descheduled process accrues none), though not immune (caches, memory bandwidth, spinning).
    cpu_axon = work.num_output_tokens / ph_axon.cpu
    cpu_pad = work.num_output_tokens / ph_pad.cpu
    cpu_seq = sub_tokens / (ph_seq1.cpu + ph_seq2.cpu)
    lines = [
        "| metric | axon | transformers | ratio | target | met |",
        "|---|---:|---:|---:|---:|:---:|",
        f"| output tok/s, {n} requests: axon all at once vs transformers one request at a time "
        f"(transformers rate measured on {len(subset)} of the {n}) "
        f"| {fmt(axon_tps)} | {fmt(hf_seq_tps)} "
        f"| {r1:.2f}x | >= {TARGET_VS_PER_REQUEST:.1f}x | {met(r1, TARGET_VS_PER_REQUEST)} |",
        f"| output tok/s, {n} requests: axon all at once vs transformers padded batch of "
        f"{hf_batch} "
        f"(useful tokens only; {computed} generated) | {fmt(axon_tps)} | {fmt(hf_pad_tps)} "
        f"| {r2:.2f}x | >= {TARGET_VS_PADDED:.1f}x | {met(r2, TARGET_VS_PADDED)} |",
        f"| batch-1 decode tok/s ({args.decode_prompt_len}-token prompt, "
        f"tokens 2..{args.decode_tokens}) "
        f"| {fmt(axon_decode, 2)} | {fmt(hf_decode, 2)} | {r3:.2f}x | >= {TARGET_DECODE:.1f}x "
        f"| {met(r3, TARGET_DECODE)} |",
        f"| batch-1 decode achieved weight bandwidth, GB/s "
        f"({read_bytes / 1e9:.3f} GB read per step) "
        f"| {fmt(bw_axon, 2)} | {fmt(bw_hf, 2)} | {r3:.2f}x | | |",
        f"| info: output tokens per process-CPU-second, axon batched vs transformers one at a time "
        f"| {fmt(cpu_axon, 2)} | {fmt(cpu_seq, 2)} | {cpu_axon / cpu_seq:.2f}x | | |",
        f"| info: output tokens per process-CPU-second, axon batched vs transformers padded "
        f"| {fmt(cpu_axon, 2)} | {fmt(cpu_pad, 2)} | {cpu_axon / cpu_pad:.2f}x | | |",
    ]
    print()
    print("\n".join(lines))
    print()
    print(
        f"raw: axon batched {t_axon:.2f}s for {work.num_output_tokens} tokens; "
        f"transformers per-request "
        f"{t_sub:.2f}s for {sub_tokens} tokens; transformers padded {t_pad:.2f}s; batch-1 axon "
        f"{a1:.3f}s/{an:.3f}s, transformers {h1:.3f}s/{hn:.3f}s (1/{args.decode_tokens} tokens); "
        f"greedy agreement on the subset {agree}/{len(subset)}; axon preemptions {preemptions}"
    )
    phases = [ph_decode, ph_seq1, ph_axon, ph_pad, ph_seq2]
    print("phases (in run order): " + "; ".join(f"{ph.name} {ph}" for ph in phases))
    res.rows = dict(
        axon_batched_tps=axon_tps,
        hf_per_request_tps=hf_seq_tps,
        hf_padded_tps=hf_pad_tps,
        axon_decode_tps=axon_decode,
        hf_decode_tps=hf_decode,
        axon_decode_gbps=bw_axon,
        hf_decode_gbps=bw_hf,
        ratio_vs_per_request=r1,
        ratio_vs_padded=r2,
        ratio_decode=r3,
        axon_tokens_per_cpu_s=cpu_axon,
        hf_padded_tokens_per_cpu_s=cpu_pad,
        hf_per_request_tokens_per_cpu_s=cpu_seq,
        t_axon=t_axon,
        t_hf_subset=t_sub,
        t_hf_padded=t_pad,
        greedy_agreement=f"{agree}/{len(subset)}",
        phases={ph.name: dict(wall=ph.wall, cpu=ph.cpu, load=ph.load) for ph in phases},
        read_bytes_per_step=read_bytes,
        total_param_bytes=total_bytes,
        args=vars(args) | {"model_dir": str(args.model_dir)},
    )
    if args.json:
        args.json.write_text(
            json.dumps({"info": res.info, "results": res.rows}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
