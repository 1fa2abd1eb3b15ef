"""llama.cpp's side of benchmarks/activation_quality.py, run by the llama-cpp-python venv's python
(no axon, no torch here). Reads a JSON job on stdin ({"model", "threads", "windows": [[token
ids], ...], "out_dir", "name", "kv_f32"}), writes the logits of every position of window i to
`out_dir/<name>-<i>.npy` (float32 [len(window), n_vocab]) and prints one JSON result line.

Each window is one llama_decode call (n_batch = n_ubatch = the window, logits for every token)
on a cleared KV cache: the same tokens, positions and step shape as axon's window prefill.
llama.cpp's defaults otherwise: an F16 KV cache and its own flash-attention choice ("kv_f32":
an F32 cache and no flash attention, so attention runs in float32 as on axon's side).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import llama_cpp as ll
import numpy as np


def load(path: str, threads: int, window: int, kv_f32: bool):
    """(model, context, n_vocab) with one batch of `window` tokens and every logit kept."""
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(path.encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    # n_ubatch = window too: one ubatch per window, as axon runs it in one step
    params.n_ctx, params.n_batch, params.n_ubatch = window, window, window
    params.n_threads, params.n_threads_batch = threads, threads
    if kv_f32:  # separates the KV cache's rounding from the activations' (Q8) rounding:
        params.type_k = params.type_v = ll.GGML_TYPE_F32
        # flash attention casts an F32 K and V to F16 (llama-graph's build_attn_mha)
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = ll.llama_init_from_model(model, params)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    return model, ctx, n_vocab


def window_logits(ctx, batch, n_vocab: int, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), n_vocab] of every position, from an empty cache."""
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    batch.n_tokens = len(tokens)
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, True
    if ll.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    out = np.empty((len(tokens), n_vocab), dtype=np.float32)
    for i in range(len(tokens)):
        out[i] = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), (n_vocab,))
    return out


def main() -> None:
    job = json.load(sys.stdin)
    window = max(len(w) for w in job["windows"])
    _, ctx, n_vocab = load(job["model"], job["threads"], window, job.get("kv_f32", False))
    batch = ll.llama_batch_init(window, 0, 1)
    files, seconds = [], 0.0
    for index, tokens in enumerate(job["windows"]):
        start = time.perf_counter()
        logits = window_logits(ctx, batch, n_vocab, tokens)
        seconds += time.perf_counter() - start
        path = Path(job["out_dir"]) / f"{job.get('name', 'llamacpp')}-{index}.npy"
        np.save(path, logits)
        files.append(str(path))
    print(json.dumps({"files": files, "n_vocab": n_vocab, "seconds": seconds}))


if __name__ == "__main__":
    main()
