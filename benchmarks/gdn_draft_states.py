"""Speculative decoding on a hybrid model: keep the Gated DeltaNet states of every draft position
during the verify step, or verify in one segment and re-run the accepted tokens afterwards?

After a verify step of 1 + k tokens with n drafts accepted, a GDN layer's conv and recurrent
state must be the one after token n + 1 of the chunk. axon keeps it: the scheduler plans a
scratch state row per draft (`draft_state_saves`) and the GDN layers split the chunk at every
draft, saving each position's state (`PrefillChunk.state_saves`); the next step copies the
accepted row into the slot. The alternative verifies the chunk in one segment (after copying
the state before the step aside), and when n < k restores that copy and runs the n + 1 accepted
tokens through the whole model again (a GDN layer's input depends on every earlier layer).

Timed through axon's runner on batches its own scheduler planned, one sequence at `--context`
tokens, float32, 1 thread, CPU time of the process, medians of alternating repeats:

    (a) verify 1 + k tokens with per-position state capture (axon's step, logits included)
    (b) the same step in one segment, plus the copy of the state before it (no capture)
    (c) j = 1..k+1 tokens from the restored state (the re-run: forward only, no LM head)

Expected cost per step at per-draft acceptance p (n accepted with P(n) = p^n (1 - p), n < k,
P(k) = p^k): capture a + P(n < k) * copy; re-run b + sum over n < k of P(n) * c(n + 1) (a
re-run is skipped when every draft is accepted). Last, the delta rule alone over the 1 + k
tokens of one GDN layer: in one segment, a segment per token (the capture), and token by token
with the recurrent rule (another way to get every position's state). The model is random,
Qwen3.5-0.8B's layer shapes but 4 layers (3 GDN + 1 full attention), written once to
~/.cache/axon-bench.

    PYTHONPATH=src python benchmarks/gdn_draft_states.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: one thread, no tuner

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from axon import LLM, SamplingParams  # noqa: E402
from axon.batch import SchedulerOutput  # noqa: E402
from axon.layers.forward_context import set_forward_context  # noqa: E402
from axon.layers.linear_attention import (  # noqa: E402
    causal_conv1d_update_ref,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from qwen3_5_decode import PRESETS, ensure_model  # noqa: E402

SHAPE = PRESETS["0.8b-4layers"]  # Qwen3.5-0.8B's layers, 4 of them: linear x3, full


def prefilled_engine(model_dir: Path, context: int, k: int):
    """An engine with one sequence whose `context` prompt tokens are computed (and its first
    token sampled): the next step is a decode that may verify drafts."""
    llm = LLM(
        model=str(model_dir), dtype="float32", max_model_len=context + 64, max_num_seqs=2,
        max_num_batched_tokens=context + 64, enable_prefix_caching=False,
        kv_cache_memory=256 << 20, adaptive_threads=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": k},
    )  # fmt: skip
    engine = llm.engine
    prompt = [random.Random(1).randrange(100, 20000) for _ in range(context)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    (seq,) = engine.add_request("bench", prompt, params)
    while seq.num_computed_tokens < context:
        engine.step()
    return engine, seq


def recurrent_capture(layer, chunk, mixed, g, beta) -> torch.Tensor:
    """A sketch of the capture done token by token with the decode form of the conv and the
    delta rule (what (a') times; not axon's code): each position's state is at hand on the
    way, so saving it is only a copy."""
    weight, slot = layer.conv1d.weight[:, 0], chunk.state_slot
    rows = dict(chunk.state_saves)  # tokens into the chunk -> state row
    rows[chunk.query_len] = slot
    conv, state = layer.conv_state[slot : slot + 1], layer.recurrent_state[slot : slot + 1]
    outs = []
    for t in range(chunk.query_len):
        x, conv = causal_conv1d_update_ref(mixed[t : t + 1], conv, weight)
        q, k, v = layer._heads(x)
        out, state = recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[t : t + 1, None], beta[t : t + 1, None],
            layer.scale, state,
        )  # fmt: skip
        if t + 1 in rows:
            layer.conv_state[rows[t + 1]] = conv[0]
            layer.recurrent_state[rows[t + 1]] = state[0]
        outs.append(out[:, 0])
    return torch.cat(outs)


class Bench:
    def __init__(self, engine, seq, k: int):
        self.runner, self.seq, self.k = engine.runner, seq, k
        self.drafts = [random.Random(2).randrange(100, 20000) for _ in range(k)]
        plan = self.runner.plan
        # A scratch row the verify step leaves alone (it takes the first k): the state copy of
        # the re-run variant.
        self.spare = plan.num_state_snapshots + k
        self.spare_row = plan.num_state_slots + self.spare
        assert self.spare < plan.num_state_snapshots + plan.num_draft_state_rows
        self.before = [(layer.conv_state[seq.state_slot].clone(),
                        layer.recurrent_state[seq.state_slot].clone())
                       for layer in self.runner._gdn_layers()]  # fmt: skip
        seq.spec_token_ids = list(self.drafts)
        verify = engine.scheduler.schedule()  # plans the draft rows, allocates the blocks
        assert verify.scheduled == [(seq, 1 + k)] and len(verify.draft_state_saves) == k
        self.verify = verify
        self.capture = self.runner.prepare(verify)
        self.one_segment = self.runner.prepare(replace(verify, draft_state_saves=[]))
        self.one_segment.state_restores = [(seq.state_slot, self.spare_row)]  # copy aside
        self.reruns = {j: self._rerun_batch(j) for j in range(1, k + 2)}
        seq.spec_token_ids = list(self.drafts)

    def _rerun_batch(self, j: int):
        """The accepted j tokens (the last one and j - 1 drafts) from the state copied aside."""
        self.seq.spec_token_ids = self.drafts[: j - 1]
        out = SchedulerOutput(
            scheduled=[(self.seq, j)], state_restores=[(self.seq.state_slot, self.spare)]
        )
        return self.runner.prepare(out)

    def reset(self) -> None:
        """Put the state before the step back into the slot (not timed)."""
        slot = self.seq.state_slot
        for layer, (conv, recurrent) in zip(self.runner._gdn_layers(), self.before):
            layer.conv_state[slot].copy_(conv)
            layer.recurrent_state[slot].copy_(recurrent)
            layer.conv_state[self.spare_row].copy_(conv)
            layer.recurrent_state[self.spare_row].copy_(recurrent)

    @torch.inference_mode()
    def forward_only(self, batch) -> None:
        self.runner._copy_states(batch.state_restores)
        with set_forward_context(batch.attn):
            self.runner.model(batch.input_ids, batch.positions)

    def copy(self) -> None:
        self.runner._copy_states([(self.spare_row, self.seq.state_slot)])

    def recurrent_step(self) -> torch.Tensor:
        """(a) with `recurrent_capture` in place of the GDN layers' segment loop."""
        layers = self.runner._gdn_layers()
        for layer in layers:
            layer._prefill = partial(recurrent_capture, layer)
        try:
            return self.runner.run_forward(self.capture)
        finally:
            for layer in layers:
                del layer._prefill

    def check_sketch(self) -> float:
        """The largest difference between (a) and (a'): logits and every saved state."""
        results = []
        for step in (lambda: self.runner.run_forward(self.capture), self.recurrent_step):
            self.reset()
            logits = step()
            rows = [row for _, _, index in self.verify.draft_state_saves
                    for row in [self.runner.plan.num_state_slots + index]]  # fmt: skip
            rows.append(self.seq.state_slot)
            states = [t[rows] for layer in self.runner._gdn_layers()
                      for t in (layer.conv_state, layer.recurrent_state)]  # fmt: skip
            results.append([logits, *states])
        return max((x - y).abs().max().item() for x, y in zip(*results))

    def cases(self) -> dict:
        cases = {
            "a": lambda: self.runner.run_forward(self.capture),
            "a2": self.recurrent_step,
            "b": lambda: self.runner.run_forward(self.one_segment),
            "copy": self.copy,
        }
        for j, batch in self.reruns.items():
            cases[f"c{j}"] = lambda batch=batch: self.forward_only(batch)
        return cases


def measure(cases: dict, repeats: int, reset=lambda: None) -> dict[str, float]:
    """Median CPU ms of each case, the cases alternating within every repeat."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, run in cases.items():
            reset()
            start = time.process_time()
            run()
            if repeat:
                times[name].append((time.process_time() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def delta_rule_cases(k: int) -> dict:
    """One GDN layer's delta rule over the 1 + k verify tokens (Qwen3.5-0.8B's 16 heads of
    128 x 128): in one chunk-rule segment, in a segment per token as axon's capture runs it
    (each padded to a 64-token chunk), and token by token with the recurrent (decode) rule,
    which yields every position's state on the way."""
    gen = torch.Generator().manual_seed(3)
    heads, dim, length = SHAPE["linear_num_value_heads"], SHAPE["linear_key_head_dim"], 1 + k
    q, key = (F.normalize(torch.randn(1, length, heads, dim, generator=gen), dim=-1)
              for _ in range(2))  # fmt: skip
    v = torch.randn(1, length, heads, dim, generator=gen)
    g = -torch.rand(1, length, heads, generator=gen)
    beta = torch.rand(1, length, heads, generator=gen)
    state = torch.randn(1, heads, dim, dim, generator=gen) * 0.1
    scale = dim**-0.5

    def per_token(rule) -> list:
        states, current = [], state
        for t in range(length):
            rows = slice(t, t + 1)
            _, current = rule(q[:, rows], key[:, rows], v[:, rows], g[:, rows], beta[:, rows],
                              scale, current)  # fmt: skip
            states.append(current)
        return states

    return {
        "one segment": lambda: chunk_gated_delta_rule(q, key, v, g, beta, scale, state),
        "segment per token": lambda: per_token(chunk_gated_delta_rule),
        "recurrent per token": lambda: per_token(recurrent_gated_delta_rule),
    }


def accepted_distribution(p: float, k: int) -> list[float]:
    """P(n drafts accepted), n = 0..k, each accepted with probability p until the first miss."""
    return [p**n * (1 - p) for n in range(k)] + [p**k]


def report(ms: dict[str, float], k: int) -> None:
    print("| case | CPU ms |")
    print("|---|---|")
    print(f"| (a) verify 1+{k}, per-position capture | {ms['a']:.2f} |")
    print(f"| (b) verify 1+{k}, one segment (+ copy aside) | {ms['b']:.2f} |")
    print(f"| capture overhead (a - b) | {ms['a'] - ms['b']:.2f} |")
    print(f"| (a') capture token by token (recurrent rule; sketch) | {ms['a2']:.2f} |")
    print(f"| its overhead (a' - b) | {ms['a2'] - ms['b']:.2f} |")
    print(f"| state copy (one row, all GDN layers) | {ms['copy']:.3f} |")
    for j in range(1, k + 2):
        print(f"| (c) re-run of {j} token(s) | {ms[f'c{j}']:.2f} |")
    print()
    print("| p | E[accepted] | capture (a) | capture (a') | re-run | re-run, always |")
    print("|---|---|---|---|---|---|")
    for p in (0.3, 0.5, 0.8):
        dist = accepted_distribution(p, k)
        mean = sum(n * q for n, q in enumerate(dist))
        capture = ms["a"] + (1 - dist[k]) * ms["copy"]
        sketch = ms["a2"] + (1 - dist[k]) * ms["copy"]
        rerun = ms["b"] + sum(q * ms[f"c{n + 1}"] for n, q in enumerate(dist[:k]))
        always = rerun + dist[k] * ms[f"c{k + 1}"]
        print(
            f"| {p:.0%} | {mean:.2f} | {capture:.2f} | {sketch:.2f} | {rerun:.2f} | {always:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine, seq = prefilled_engine(ensure_model("0.8b-4layers"), args.context, args.k)
    bench = Bench(engine, seq, args.k)
    print(f"(a) vs (a'): largest difference {bench.check_sketch():.2e} (logits, saved states)")
    started = time.perf_counter()
    ms = measure(bench.cases(), args.repeats, bench.reset)
    print(f"{args.repeats} repeats, context {args.context}, k={args.k}, "
          f"{time.perf_counter() - started:.0f} s of timing\n")  # fmt: skip
    report(ms, args.k)
    rule = measure(delta_rule_cases(args.k), args.repeats)
    layers = SHAPE["num_hidden_layers"] * 3 // 4
    print(f"\n| delta rule over 1+{args.k} tokens | CPU ms, one GDN layer | x {layers} layers |")
    print("|---|---|---|")
    for name, value in rule.items():
        print(f"| {name} | {value:.2f} | {value * layers:.2f} |")
    engine.close()


if __name__ == "__main__":
    main()
