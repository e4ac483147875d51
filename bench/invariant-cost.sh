#!/usr/bin/env bash
# What world-size-invariant training costs: samples/s of `distributed.deterministic =
# "world-size-invariant"` against the default mode, the same global batch in both, for the cnn
# (configs/fashion-mnist.toml: 256 samples a step, virtual_shards 8) and the GPT
# (configs/shakespeare-char.toml: 12 windows a step, virtual_shards 4), each on 1 worker x 2
# threads and 2 workers x 1 thread, the modes alternated ROUNDS times in one run; prints each
# run's training samples/s (summary.json) and the median ratios.
#
#   bench/invariant-cost.sh [ROUNDS] [STEPS]        (default: 3 rounds of 60 steps)
#   GPT_PIECES=2 CNN_PIECES=4 bench/invariant-cost.sh   other virtual_shards
#   MODELS=gpt bench/invariant-cost.sh 5                  one model only
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
rounds=${1:-3}
steps=${2:-60}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
lscpu | sed -n 's/^Model name: *//p'
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
# The job files with the global batch in place of the per-worker one, no accumulation.
sed -e 's/^batch_size = .*/global_batch_size = 256/' -e 's/^accumulation = .*//' \
  "$here/configs/fashion-mnist.toml" > "$out/cnn.toml"
# (a few steps miss the recipe's [expect] loss: not what is measured here)
sed -e 's/^batch_size = .*/global_batch_size = 12/' -e "s|^path = .*|path = \"$text\"|" \
  -e 's/^max_test_loss = .*//' "$here/configs/shakespeare-char.toml" > "$out/gpt.toml"
declare -A pieces=([cnn]=${CNN_PIECES:-8} [gpt]=${GPT_PIECES:-4})
for r in $(seq 1 "$rounds"); do
  for model in ${MODELS:-cnn gpt}; do
    for layout in 1x2 2x1; do
      for mode in run world-size-invariant; do
        name=$model-$layout-$mode-$r
        RAYON_NUM_THREADS=${layout#*x} "$bin" run "$out/$model.toml" --jobs-dir "$out/jobs" \
          --name "$name" --nproc-per-node "${layout%x*}" \
          --set "train.max_steps=$steps" --set train.eval_every=0 --set train.eval_batches=1 \
          --set checkpoint.every_steps=0 --set checkpoint.every_epochs=0 \
          --set "distributed.deterministic=\"$mode\"" \
          --set "distributed.virtual_shards=${pieces[$model]}" > "$out/$name.log" 2>&1 \
          || { cat "$out/$name.log" >&2; exit 1; }
      done
    done
  done
done
python3 - "$out/jobs" "$rounds" ${MODELS:-cnn gpt} <<'PY'
import json, statistics, sys
jobs, rounds, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rate = lambda name: json.load(open(f"{jobs}/{name}/summary.json"))["train_samples_per_s"]
for model in models:
    for layout in ("1x2", "2x1"):
        med = {}
        for mode in ("run", "world-size-invariant"):
            v = [rate(f"{model}-{layout}-{mode}-{r}") for r in range(1, rounds + 1)]
            med[mode] = statistics.median(v)
            print(f"{model} {layout} {mode:<21} samples/s {' '.join(f'{x:.0f}' for x in v)}  median {med[mode]:.0f}")
        print(f"{model} {layout} invariant / default: {med['world-size-invariant'] / med['run']:.3f}")
PY
