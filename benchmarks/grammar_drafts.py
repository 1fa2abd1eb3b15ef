"""What a grammar costs under speculative decoding: the CPU time of the grammar masks (one per
verified row, each after the drafts before it) against the whole step's, on a json_schema
request to a demo GGUF, with and without n-gram drafts.

    python benchmarks/grammar_drafts.py [--model PATH] [--requests 3] [--max-tokens 160]

CPU time is the process's (user + sys, llguidance's mask threads included), measured around
each `apply_masks` call and around each whole `generate`; a busy machine leaves it steady
where wall-clock time is noise. Batch 1: the requests run one after another.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from axon import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "city", "age", "tags"],
    "additionalProperties": False,
}
PEOPLE = [
    {"name": "Ada", "city": "London", "age": 36, "tags": ["math", "engines"]},
    {"name": "Alan", "city": "Wilmslow", "age": 41, "tags": ["logic", "codes"]},
    {"name": "Grace", "city": "Arlington", "age": 85, "tags": ["compilers", "navy"]},
]


def prompt(index: int) -> str:
    """A request whose answer copies most of the prompt: a record, reformatted."""
    record = json.dumps(PEOPLE[index % len(PEOPLE)])
    return f"Repeat this record as JSON, exactly:\n{record}\nJSON:"


def measure(llm: LLM, args: argparse.Namespace) -> dict:
    """CPU seconds in the grammar masks and in all, over `args.requests` requests."""
    structured = llm.engine.structured
    apply_masks = structured.apply_masks
    spent = {"masks": 0.0, "mask_calls": 0, "rows": 0}

    def timed(matchers, logits, drafts=None):
        start = time.process_time()
        apply_masks(matchers, logits, drafts)
        spent["masks"] += time.process_time() - start
        spent["mask_calls"] += 1
        spent["rows"] += logits.shape[0]

    structured.apply_masks = timed
    spec = {"type": "json_schema", "schema": SCHEMA}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_output=spec)
    llm.generate([prompt(0)], params)  # warm: the grammar compiled, the tokenizer built
    spent.update(masks=0.0, mask_calls=0, rows=0)
    before = llm.engine.stats()
    start, tokens = time.process_time(), 0
    for index in range(args.requests):
        (output,) = llm.generate([prompt(index)], params)
        tokens += len(output.outputs[0].token_ids)
    total = time.process_time() - start
    stats = llm.engine.stats()
    drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    return {
        "tokens": tokens,
        "cpu_s": round(total, 3),
        "mask_cpu_s": round(spent["masks"], 3),
        "mask_share": round(spent["masks"] / total, 4),
        "mask_ms_per_step": round(1e3 * spent["masks"] / max(1, spent["mask_calls"]), 3),
        "mask_ms_per_row": round(1e3 * spent["masks"] / max(1, spent["rows"]), 3),
        "steps": spent["mask_calls"],
        "drafted": drafted,
        "accepted": accepted,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the chat demo)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    args = parser.parse_args(argv)
    if args.model is None:
        from axon.demo import chat_demo_model_path

        args.model = chat_demo_model_path()
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    for name, config in (("no drafts", None), (f"ngram k={args.k}", ngram)):
        llm = LLM(str(args.model), speculative_config=config)
        print(json.dumps({"variant": name, "model": args.model.name, **measure(llm, args)}))
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
