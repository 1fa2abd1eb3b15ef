"""llama.cpp's side of benchmarks/gguf_vs_llamacpp.py, run by the llama-cpp-python venv's python
(no axon, no torch here). Reads a JSON job on stdin, prints one JSON result line.

With `"engine": "ik_llama.cpp"` in the job it drives ik_llama.cpp instead, through the ctypes
bindings of the ik-llama-cpp-python sdist (`ik_llama_cpp`, on PYTHONPATH, loading the library
IK_LLAMA_CPP_LIB_PATH names): the same calls, its run-time repack on (`-rtr`), flash attention
off with several sequences as its server runs (benchmarks/ik_llama.py), and its older KV clear.

Everything goes through llama.cpp's batched C API (llama_batch with one sequence id per stream),
the way its `batched` example and its server's parallel slots drive it; sampling is greedy
(argmax of each sequence's logits), as on axon's side.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

ll = None  # the C API's module, set by `binding`
IK = False  # whether it is ik_llama.cpp's
MAX_BATCH = 2048  # tokens of one llama_decode call: every prompt of a run fits in one


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def binding(engine: str):
    """The C API's Python module: llama-cpp-python's, or the ik_llama.cpp sdist's."""
    global ll, IK
    IK = engine == "ik_llama.cpp"
    if IK:
        from ik_llama_cpp import _ctypes_api as module
    else:
        import llama_cpp as module
    ll = module


def load(path: str, threads: int, n_ctx: int, n_seq: int):
    ll.llama_backend_init()
    model_params = ll.llama_model_default_params()
    if IK:
        model_params.repack_tensors = True
    model = ll.llama_model_load_from_file(path.encode(), model_params)
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, MAX_BATCH, MAX_BATCH
    params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq, threads, threads
    if IK and n_seq > 1:
        params.flash_attn = False
    ctx = ll.llama_init_from_model(model, params)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    return model, ctx, n_vocab


def decode(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
    """entries: (token, position, sequence, wants logits)."""
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    if ll.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def argmax(ctx, index: int, n_vocab: int) -> int:
    return int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, index), (n_vocab,)).argmax())


def generate(ctx, batch, n_vocab: int, prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy `new_tokens` for every prompt at once (one sequence each); returns seconds."""
    if IK:
        ll.llama_kv_cache_clear(ctx)
    else:
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    start = time.perf_counter()
    entries = [
        (tok, pos, seq, pos == len(p) - 1)
        for seq, p in enumerate(prompts)
        for pos, tok in enumerate(p)
    ]
    decode(ctx, batch, entries)  # every prompt in one batch (at most MAX_BATCH tokens)
    last = [argmax(ctx, i, n_vocab) for i, entry in enumerate(entries) if entry[3]]
    positions = [len(p) for p in prompts]
    for _ in range(new_tokens - 1):
        decode(ctx, batch, [(t, pos, s, True) for s, (t, pos) in enumerate(zip(last, positions))])
        last = [argmax(ctx, i, n_vocab) for i in range(len(prompts))]
        positions = [p + 1 for p in positions]
    return time.perf_counter() - start


def main() -> None:
    job = json.load(sys.stdin)
    binding(job.get("engine", "llama.cpp"))
    base = rss()
    n_seq = max(job["streams"] + [1])
    _, ctx, n_vocab = load(job["model"], job["threads"], job["n_ctx"], n_seq)
    batch = ll.llama_batch_init(MAX_BATCH, 0, n_seq)
    generate(ctx, batch, n_vocab, [job["decode_prompt"][:8]], 2)  # warm up
    resident = rss() - base
    prefill = generate(ctx, batch, n_vocab, [job["prefill_prompt"]], 1)
    one = generate(ctx, batch, n_vocab, [job["decode_prompt"]], 1)
    full = generate(ctx, batch, n_vocab, [job["decode_prompt"]], job["decode_tokens"])
    streams = {}
    for count in job["streams"]:
        prompts = job["stream_prompts"][:count]
        streams[str(count)] = (
            count
            * job["stream_tokens"]
            / generate(ctx, batch, n_vocab, prompts, job["stream_tokens"])
        )
    print(
        json.dumps(
            {
                "rss_bytes": resident,
                "prefill_tok_s": len(job["prefill_prompt"]) / prefill,
                "decode_tok_s": (job["decode_tokens"] - 1) / (full - one),
                "streams_tok_s": streams,
            }
        )
    )


if __name__ == "__main__":
    main()
