#!/usr/bin/env bash
# Two checkouts of axon served on the demo model in the same run, alternating, so a refactor
# can show that serving speed did not move: for each round, `axon serve` from BASE_SRC then
# from NEW_SRC, each measured by `axon bench serve` at concurrency 1 and 16 (16 prompts of 128
# random tokens, 64 output tokens, greedy); then a table of every round and the new/base ratios
# of output tok/s. Make the base checkout with `git worktree add --detach DIR REV`.
#
#   bash benchmarks/serve_ab.sh BASE_SRC NEW_SRC [ROUNDS] [OUTDIR]
#   bash benchmarks/serve_ab.sh ../base/src src 3 /tmp/ab
set -euo pipefail
BASE=$(realpath "$1"); NEW=$(realpath "$2"); ROUNDS=${3:-2}; OUT=${4:-/tmp/axon-serve-ab}
PY=${PY:-$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/python}
mkdir -p "$OUT"
rm -f "$OUT"/*.json
echo "CPU: $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
run_one() { # label src round
  local label=$1 src=$2 r=$3 port=$((8300 + RANDOM % 500))
  PYTHONPATH=$src $PY -m axon serve --port $port --log-level warning --max-num-seqs 16 > "$OUT/$label-$r.server.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/v1/models 2>/dev/null | grep -q gemma && break; sleep 1; done
  PYTHONPATH=$src $PY -m axon bench serve --base-url http://127.0.0.1:$port --concurrency 1,16 \
     --num-prompts 16 --random-input-len 128 --random-output-len 64 --num-warmups 2 --disable-tqdm \
     --result-json "$OUT/$label-$r.json" > "$OUT/$label-$r.txt" 2>&1 || echo "bench failed $label $r"
  kill $pid; wait $pid 2>/dev/null || true
}
for r in $(seq 1 $ROUNDS); do run_one base "$BASE" $r; run_one new "$NEW" $r; done
$PY - "$OUT" <<'PY'
import json, sys, pathlib, collections, statistics
out = pathlib.Path(sys.argv[1]); rows = collections.defaultdict(list)
for f in sorted(out.glob("*.json")):
    label = f.stem.split("-")[0]
    for level in json.loads(f.read_text())["levels"]:
        rows[(level["max_concurrency"], label)].append(level)
keys = ["output_throughput", "median_ttft_ms", "median_itl_ms", "median_tpot_ms", "p99_ttft_ms"]
print("| concurrency | tree | " + " | ".join(keys) + " |")
print("|---|---|" + "---|" * len(keys))
for (c, label), levels in sorted(rows.items()):
    vals = [" / ".join(f"{lv.get(k, float('nan')):.1f}" for lv in levels) for k in keys]
    print(f"| {c} | {label} | " + " | ".join(vals) + " |")
for c in sorted({c for c, _ in rows}):
    b = [lv["output_throughput"] for lv in rows[(c, "base")]]; n = [lv["output_throughput"] for lv in rows[(c, "new")]]
    if b and n: print(f"concurrency {c}: new/base output tok/s, best of rounds: {max(n)/max(b):.3f}; medians: {statistics.median(n)/statistics.median(b):.3f}")
PY
