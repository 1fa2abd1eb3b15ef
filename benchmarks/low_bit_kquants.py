"""Times Q2_K and Q3_K matmuls: the PyTorch dequantization on every call (what QuantizedMatmul
did for them before their C kernels), the float32-exact C kernel (kernels/ggml_cpu.c) and the
int8-activation one (kernels/ggml_q8.c), with Q4_K on the same shape beside them. One thread,
thread CPU time, the variants taking turns (benchmarks/int8_matmul.py's per_call_us), so a shared
machine's load moves them alike.

Run: PYTHONPATH=src python benchmarks/low_bit_kquants.py [--rows 576] [--cols 1536]
(~1 minute; the default shape is SmolLM2-135M's down_proj, the demo's Q3_K tensors).

--demo FILE: instead, a GGUF end to end in process (LLM.generate, one thread, greedy, EOS
ignored): process CPU time per decode token, 128 tokens after a chat prompt, exact and int8
activations (~1 minute). A file with Q2_K / Q3_K tensors, e.g. the speculative benchmark's
draft, ~/.cache/axon-bench/SmolLM2-135M-Instruct.Q4_1-Q2_K.gguf (its down_proj are Q3_K). With
PYTHONPATH pointing at an older tree it times that tree's code: the before of a change.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from axon.kernels import ggml_cpu  # noqa: E402
from axon.kernels.ggml_dequant import dequantize_rows_ref  # noqa: E402
from int8_matmul import SCALE_OFFSETS, kernels, per_call_us, random_raw  # noqa: E402

T = GGMLQuantizationType
SCALE_OFFSETS |= {T.Q2_K: (80, 82), T.Q3_K: (108,)}


def row(qtype: T, rows: int, cols: int, tokens: int) -> list[float]:
    """[dequant path, exact, int8] microseconds per call (dequant: Q2_K / Q3_K only)."""
    raw = random_raw(qtype, rows, cols)
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], cols, int8=True)
    x = torch.randn(tokens, cols)
    out = torch.empty(tokens, rows)
    exact, int8 = kernels(weights, x, out, threads=1)
    fns = [exact, int8]
    if qtype != T.Q4_K:
        fns.insert(0, lambda: F.linear(x, dequantize_rows_ref(raw, int(qtype), cols)))
    times = per_call_us(fns, time.thread_time, budget_s=1.5)
    return times if qtype != T.Q4_K else [float("nan"), *times]


def demo(path: str, tokens: int = 128) -> None:
    """Decode CPU time per token of the GGUF at `path`, float32 and int8 activations."""
    from axon import LLM, SamplingParams

    prompt = (
        "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    print(f"{path}: decode, 1 thread, process CPU time per token (ms)")
    for precision in ("float32", "int8"):
        llm = LLM(model=path, max_model_len=1024, adaptive_threads=False,
                  activation_precision=precision)  # fmt: skip
        costs = {}
        for count in (1, tokens + 1, 1, tokens + 1):  # the second pair after a warm first
            params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
            start = time.process_time()
            (output,) = llm.generate([prompt], params)
            costs[count] = time.process_time() - start
            assert len(output.outputs[0].token_ids) == count
        per_token = (costs[tokens + 1] - costs[1]) / tokens
        print(f"| {precision} | {per_token * 1e3:.2f} ms |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=576)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--demo", help="a GGUF file: decode CPU time per token end to end")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.demo:
        return demo(args.demo)
    print(f"W {args.rows} x {args.cols}, 1 thread, thread CPU time per call (us)")
    print("| type | tokens | dequant (before) | exact | int8 | before / exact | before / int8 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for qtype in (T.Q2_K, T.Q3_K, T.Q4_K):
        for tokens in args.tokens:
            before, exact, int8 = row(qtype, args.rows, args.cols, tokens)
            print(
                f"| {qtype.name} | {tokens} | {before:.0f} | {exact:.1f} | {int8:.1f} "
                f"| {before / exact:.1f} | {before / int8:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
