#!/usr/bin/env bash
# ddpjob's DPO beside TRL's DPOTrainer + peft on SmolLM2-135M's shape (random weights, the same
# directory and pairs for both; bench/dpo_ref.py makes them), LoRA r 16 on the seven
# projections, 4 pairs a step of about 128 + 64 tokens a row, 1 process x all cores: seconds a
# step (median after two) and the ratio, the steps' losses side by side, and each program's
# peak RSS, with the reference live (the base with the adapters off) and precomputed
# (`precompute_reference`, TRL's `precompute_ref_log_probs`). Then ddpjob's full fine-tune
# (no LoRA), whose live reference is a frozen copy: its peak with and without precomputing.
#
#   bench/dpo-vs-trl.sh [ROUNDS]           LAYERS=2 for a quick check of the set-up
#
# Needs: a release build (cargo build --release) and a Python with torch, transformers, trl,
# peft and datasets (PYTHON). The model and pairs are made once under WORK.
set -euo pipefail
rounds=${1:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
layers=${LAYERS:-0}
steps=${STEPS:-8}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
work=${WORK:-/tmp/dpo-bench-$layers}
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
threads=$(nproc)
mkdir -p "$work"
[ -f "$work/job.toml" ] || "$python" "$here/bench/dpo_ref.py" prepare "$work" "$text" --layers "$layers" > /dev/null 2>&1
lscpu | sed -n 's/^Model name: *//p'
jobs=$(mktemp -d); trap 'rm -rf "$jobs"' EXIT
peak() { sed -n 's/^PEAK //p' "$1"; }
for r in $(seq 1 "$rounds"); do
  for mode in live precomputed; do
    pre=false; flag=(); [ $mode = precomputed ] && { pre=true; flag=(--precompute); }
    /usr/bin/time -f "PEAK %M" -o "$jobs/ours-$mode-$r.rss" "$bin" run "$work/job.toml" \
      --jobs-dir "$jobs" --name "ours-$mode-$r" --set train.max_steps="$steps" \
      --set train.dpo.precompute_reference=$pre > /dev/null 2>&1
    OMP_NUM_THREADS=$threads "$python" "$here/bench/dpo_ref.py" train "$work" --steps "$steps" \
      --threads "$threads" "${flag[@]}" 2> /dev/null | tail -1 > "$jobs/trl-$mode-$r.json"
  done
  for mode in live precomputed; do
    pre=false; [ $mode = precomputed ] && pre=true
    sed '/^\[model.lora\]/,/^target_modules/d' "$work/job.toml" > "$jobs/full.toml"
    /usr/bin/time -f "PEAK %M" -o "$jobs/full-$mode-$r.rss" "$bin" run "$jobs/full.toml" \
      --jobs-dir "$jobs" --name "full-$mode-$r" --set train.max_steps="$steps" \
      --set train.dpo.precompute_reference=$pre > /dev/null 2>&1
  done
done
"$python" - "$jobs" "$rounds" <<'PY'
import json, statistics, sys
from pathlib import Path
jobs, rounds = Path(sys.argv[1]), int(sys.argv[2])
def peak(name):
    return int(Path(jobs / name).read_text().split("PEAK ")[1].split()[0]) * 1024 / 1e6
def ours(name):
    steps = [json.loads(l) for l in open(jobs / name / "metrics.jsonl") if '"kind":"train"' in l]
    return statistics.median(4 / s["samples_per_s"] for s in steps[2:]), [s["loss"] for s in steps]
for mode in ["live", "precomputed"]:
    rows = []
    for r in range(1, rounds + 1):
        o_s, o_losses = ours(f"ours-{mode}-{r}")
        ref = json.load(open(jobs / f"trl-{mode}-{r}.json"))
        rows.append((o_s, ref["step_s"], peak(f"ours-{mode}-{r}.rss"), ref["peak_rss_bytes"] / 1e6))
        # Both start at ln 2 (policy = reference); after that the batches (each its own
        # shuffle) and the adapters' random A differ, so the steps are not comparable.
        print(f"{mode} round {r}: first loss ddpjob {o_losses[0]:.4f}, TRL {ref['losses'][0]:.4f}")
    m = [statistics.median(c) for c in zip(*rows)]
    print(f"--- LoRA r 16, reference {mode}")
    print(f"{'':20}{'ddpjob':>10}{'TRL+peft':>10}{'ratio':>8}")
    print(f"{'steps/s':20}{1 / m[0]:10.3f}{1 / m[1]:10.3f}{m[1] / m[0]:8.2f}")
    print(f"{'peak RSS MB':20}{m[2]:10.0f}{m[3]:10.0f}{m[2] / m[3]:8.2f}")
full = {mode: statistics.median(peak(f"full-{mode}-{r}.rss") for r in range(1, rounds + 1))
        for mode in ["live", "precomputed"]}
speed = {mode: statistics.median(ours(f"full-{mode}-{r}")[0] for r in range(1, rounds + 1))
         for mode in ["live", "precomputed"]}
print("--- ddpjob full fine-tune (frozen-copy reference)")
print(f"peak RSS MB live {full['live']:.0f}, precomputed {full['precomputed']:.0f}: "
      f"{full['precomputed'] / full['live']:.2f}x; s/step {speed['live']:.2f} vs {speed['precomputed']:.2f}")
PY
