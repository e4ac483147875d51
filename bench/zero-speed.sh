#!/usr/bin/env bash
# Sharded optimizer state costs no speed: configs/shakespeare-char.toml on 2 workers x 1 thread,
# `distributed.sharding` "none", "optimizer" (ZeRO-1) and "gradients" (ZeRO-2) alternated ROUNDS
# times in one run; prints each run's training tokens/s (summary.json) and the median ratios.
#
#   bench/zero-speed.sh [ROUNDS] [STEPS]        (default: 3 rounds of 400 steps)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
rounds=${1:-3}
steps=${2:-400}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
lscpu | sed -n 's/^Model name: *//p'
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for mode in none optimizer gradients; do
    RAYON_NUM_THREADS=1 "$bin" run "$here/configs/shakespeare-char.toml" --jobs-dir "$out/jobs" \
      --name "$mode-$r" --nproc-per-node 2 --set "data.path=\"$text\"" \
      --set "train.max_steps=$steps" --set train.eval_every=0 --set checkpoint.every_steps=0 \
      --set expect.max_test_loss=100 --set "distributed.sharding=\"$mode\"" \
      > "$out/$mode-$r.log" 2>&1 \
      || { cat "$out/$mode-$r.log" >&2; exit 1; }
  done
done
python3 - "$out/jobs" "$rounds" <<'PY'
import json, statistics, sys
jobs, rounds = sys.argv[1], int(sys.argv[2])
rate = lambda name: json.load(open(f"{jobs}/{name}/summary.json"))["train_tokens_per_s"]
modes = ("none", "optimizer", "gradients")
rows = {m: [rate(f"{m}-{r}") for r in range(1, rounds + 1)] for m in modes}
for m, v in rows.items():
    print(f"{m:<10} tokens/s {' '.join(f'{x:.0f}' for x in v)}  median {statistics.median(v):.0f}")
for m in modes[1:]:
    print(f"{m} / none: {statistics.median(rows[m]) / statistics.median(rows['none']):.3f}")
PY
