#!/usr/bin/env bash
# ddpjob's `llama` beside transformers' LlamaForCausalLM on SmolLM2-135M's shape (random weights,
# the same directory for both), 1 process x all cores: the loss of each of the first STEPS
# training steps from the same weights on the same windows, training tokens/s (median step
# after two), `eval` tokens/s of the validation split (ddpjob eval vs torch.no_grad()), and the
# seconds to load the checkpoint. Alternates the two programs ROUNDS times; prints medians and
# the ratios ddpjob / transformers.
#
#   bench/llama-vs-transformers.sh [ROUNDS]        LAYERS=2 for a quick check of the set-up
#
# SHAPE=qwen3-0.6b: Qwen3-0.6B's shape (context 512, batch 1); SHAPE=qwen3-moe: a small
# Qwen3-MoE (8 layers, 64 experts of 256, 8 per token), where transformers runs twice, with its
# experts one after another (`experts_implementation="eager"`) and with its default
# (`grouped_mm` where torch has it), each ratio printed.
#
# PRECISION=bf16-matmul: both programs in f32 with bf16 matrix products (ddpjob's
# `train.precision = "bf16-matmul"`, torch's `set_float32_matmul_precision("medium")` with
# oneDNN's bf16 products); the losses then differ by more than the f32 runs' 1e-3.
#
# Needs: a release build (cargo build --release) and a Python with torch, transformers and
# tokenizers (PYTHON; see ../shared/bench/README.md). The model directory and the tokenised
# text are made once under WORK (default /tmp/llama-bench-$LAYERS).
set -euo pipefail
rounds=${1:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
shape=${SHAPE:-smollm2}
layers=${LAYERS:-0}
steps=${STEPS:-10}
precision=${PRECISION:-f32}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
work=${WORK:-/tmp/llama-bench-$shape-$layers}
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
[ -f "$text" ] || { echo "no $text: set TEXT" >&2; exit 2; }
threads=$(nproc)
if [ ! -f "$work/job.toml" ]; then
  "$python" "$here/bench/llama_ref.py" prepare "$work" "$text" --layers "$layers" --shape "$shape" > /dev/null 2>&1
fi
lscpu | sed -n 's/^Model name: *//p'
echo "shape: $shape, precision: $precision"
case $shape in qwen3-moe) refs="eager default" ;; *) refs="default" ;; esac
jobs=$(mktemp -d); trap 'rm -rf "$jobs"' EXIT
for r in $(seq 1 "$rounds"); do
  "$bin" run "$work/job.toml" --jobs-dir "$jobs" --name "bench-$r" --set train.max_steps="$steps" \
    --set train.precision="$precision" > /dev/null 2>&1
  # The trained weights, as transformers scores its own; then the directory's load alone.
  "$bin" eval "bench-$r" --jobs-dir "$jobs" --json > "$jobs/eval-$r.json"
  "$bin" eval "$work/model" --data "$work/job.toml" --set train.eval_batches=1 --json > "$jobs/load-$r.json"
  for ref in $refs; do
    experts=(); [ "$ref" = default ] || experts=(--experts "$ref")
    OMP_NUM_THREADS=$threads "$python" "$here/bench/llama_ref.py" train "$work" --steps "$steps" \
      --threads "$threads" --precision "$precision" "${experts[@]}" 2> /dev/null | tail -1 \
      > "$jobs/ref-$ref-$r.json"
  done
done
"$python" - "$jobs" "$rounds" "$work/job.toml" $refs <<'EOF'
import json, statistics, sys
from pathlib import Path
jobs, rounds, refs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[4:]
block = int(Path(sys.argv[3]).read_text().split("block_size = ")[1].split()[0])
for name in refs:
  print(f"--- transformers, experts: {name}")
  rows = []
  for r in range(1, rounds + 1):
    job = jobs / f"bench-{r}"
    steps = [json.loads(l) for l in open(job / "metrics.jsonl") if '"kind":"train"' in l]
    ours_losses = [s["loss"] for s in steps]
    ours_rate = statistics.median(s["samples_per_s"] for s in steps[2:]) * block
    ev = json.load(open(jobs / f"eval-{r}.json"))
    ev["load_s"] = json.load(open(jobs / f"load-{r}.json"))["load_s"]
    ref = json.load(open(jobs / f"ref-{name}-{r}.json"))
    diff = max(abs(a - b) for a, b in zip(ours_losses, ref["losses"]))
    rows.append((ours_rate, ref["train_tokens_per_s"], ev["per_s"], ref["eval_tokens_per_s"],
                 ev["load_s"], ref["load_s"], diff, ev["loss"], ref["eval_loss"]))
    print(f"round {r}: losses ddpjob {[round(x, 5) for x in ours_losses]}")
    print(f"         transformers {[round(x, 5) for x in ref['losses']]}  max |diff| {diff:.2e}")
  med = [statistics.median(c) for c in zip(*rows)]
  print(f"{'':22}{'ddpjob':>12}{'transformers':>14}{'ratio':>8}")
  print(f"{'train tokens/s':22}{med[0]:12.0f}{med[1]:14.0f}{med[0] / med[1]:8.2f}")
  print(f"{'eval tokens/s':22}{med[2]:12.0f}{med[3]:14.0f}{med[2] / med[3]:8.2f}")
  print(f"{'load dir s':22}{med[4]:12.2f}{med[5]:14.2f}")
  print(f"{'eval loss':22}{med[7]:12.5f}{med[8]:14.5f}")
  print(f"max |loss diff| over the first steps: {med[6]:.2e}")
EOF
