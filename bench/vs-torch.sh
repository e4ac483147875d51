#!/usr/bin/env bash
# Side-by-side training throughput: ddpjob vs ../shared/bench/torch_ref.py on Fashion-MNIST,
# same model, Adam lr 1e-3, batch 64, one epoch (cnn: capped at 200 steps), alternating the two
# programs ROUNDS times. Prints each run's train_samples_per_s and test accuracy, then medians
# and the ratio ddpjob / torch.
#
#   bench/vs-torch.sh mlp [ROUNDS]     PYTHON=/tmp/torchref/bin/python bench/vs-torch.sh cnn 3
#
# Needs: a release build (cargo build --release), Debian's dataset-fashion-mnist, and a Python
# with torch and numpy (see ../shared/bench/README.md).
set -euo pipefail
model=${1:?usage: bench/vs-torch.sh mlp|cnn [ROUNDS]}
rounds=${2:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
torch_ref=${TORCH_REF:-$here/../shared/bench/torch_ref.py}
bin=$here/target/release/ddpjob
data=/usr/share/datasets/fashion-mnist
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
[ -f "$torch_ref" ] || { echo "no $torch_ref: set TORCH_REF" >&2; exit 2; }
limit=0; sets=()
if [ "$model" = cnn ]; then limit=200; sets+=(--set train.max_steps=200); fi
jobs=$(mktemp -d); trap 'rm -rf "$jobs"' EXIT

ours=(); theirs=()
for r in $(seq 1 "$rounds"); do
  "$bin" run "$here/configs/fashion-mnist.toml" --jobs-dir "$jobs" --name "bench-$r" \
    --set model.arch="$model" --set train.epochs=1 --set train.accumulation=1 --set train.lr=0.001 \
    --set train.weight_decay=0 --set train.grad_clip_norm=0 --set 'data.mean=[]' --set 'data.std=[]' \
    --set train.log_every=100000 --set checkpoint.every_epochs=0 "${sets[@]}" > /dev/null
  a=$("$python" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(round(s["train_samples_per_s"]), round(s["test_accuracy"],4))' "$jobs/bench-$r/summary.json")
  b=$("$python" "$torch_ref" --model "$model" --threads "$(nproc)" --limit-steps "$limit" --data-dir "$data" \
      | "$python" -c 'import json,sys; s=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(round(s["train_samples_per_s"]), round(s["test_accuracy"],4))')
  echo "round $r: ddpjob ${a% *} samples/s (acc ${a#* })   torch ${b% *} samples/s (acc ${b#* })"
  ours+=("${a% *}"); theirs+=("${b% *}")
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
mo=$(median "${ours[@]}"); mt=$(median "${theirs[@]}")
echo "$model median: ddpjob $mo samples/s, torch $mt samples/s, ratio $(awk -v a="$mo" -v b="$mt" 'BEGIN {printf "%.2f", a/b}')"
