#!/usr/bin/env bash
# Side-by-side training throughput: ddpjob vs ../shared/bench/torch_ref.py on Fashion-MNIST,
# same model, Adam lr 1e-3, batch 64 per process, one epoch (cnn: capped at 200 steps),
# alternating the two programs ROUNDS times. Prints each run's train_samples_per_s, test
# accuracy and whole-command wall time, then medians and the ratios ddpjob / torch.
#
#   bench/vs-torch.sh mlp [ROUNDS]     PYTHON=/tmp/torchref/bin/python bench/vs-torch.sh cnn 3
#   NPROC=2 bench/vs-torch.sh mlp 3    2 workers x 1 thread vs torchrun 2 x 1 thread (gloo DDP)
#   DEVICE=cuda DATA=data/fashion-mnist BIN=target/gpu-dist/run-gpu.sh\ target/gpu-dist/ddpjob \
#     bench/vs-torch.sh cnn 3          on a GPU: the whole epoch, torch_ref.py --device cuda
#
# Needs: a release build (cargo build --release), Debian's dataset-fashion-mnist, and a Python
# with torch and numpy (see ../shared/bench/README.md).
set -euo pipefail
model=${1:?usage: bench/vs-torch.sh mlp|cnn [ROUNDS]}
rounds=${2:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
nproc=${NPROC:-1}
torchrun=${TORCHRUN:-$(dirname "$python")/torchrun}
torch_ref=${TORCH_REF:-$here/../shared/bench/torch_ref.py}
read -r -a bin <<< "${BIN:-$here/target/release/ddpjob}"   # may be a wrapper and the binary
data=${DATA:-/usr/share/datasets/fashion-mnist}
device=${DEVICE:-cpu}
[ -x "${bin[-1]}" ] || { echo "no ${bin[-1]}: run cargo build --release first" >&2; exit 2; }
[ -f "$torch_ref" ] || { echo "no $torch_ref: set TORCH_REF" >&2; exit 2; }
limit=0; sets=(--set "data.root=$data" --set distributed.device="$device"); torch_device=()
if [ "$device" = cuda ]; then torch_device=(--device cuda)
elif [ "$model" = cnn ]; then limit=200; sets+=(--set train.max_steps=200); fi
jobs=$(mktemp -d); trap 'rm -rf "$jobs"' EXIT

threads=$(( $(nproc) / nproc )); [ "$threads" -ge 1 ] || threads=1
if [ "$nproc" -gt 1 ]; then
  torch_cmd=("$torchrun" --standalone --nproc-per-node="$nproc" "$torch_ref")
else
  torch_cmd=("$python" "$torch_ref")
fi
now() { date +%s.%N; }
ours=(); theirs=(); ours_wall=(); theirs_wall=()
for r in $(seq 1 "$rounds"); do
  t0=$(now)
  "${bin[@]}" run "$here/configs/fashion-mnist.toml" --jobs-dir "$jobs" --name "bench-$r" \
    --set model.arch="$model" --set train.epochs=1 --set train.accumulation=1 --set train.lr=0.001 \
    --set train.weight_decay=0 --set train.grad_clip_norm=0 --set 'data.mean=[]' --set 'data.std=[]' \
    --set train.log_every=100000 --set checkpoint.every_epochs=0 --nproc-per-node "$nproc" "${sets[@]}" > /dev/null
  t1=$(now)
  a=$("$python" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(round(s["train_samples_per_s"]), round(s["test_accuracy"],4))' "$jobs/bench-$r/summary.json")
  t2=$(now)
  b=$(OMP_NUM_THREADS=$threads "${torch_cmd[@]}" --model "$model" --threads "$threads" --limit-steps "$limit" --data-dir "$data" "${torch_device[@]}" 2>/dev/null \
      | "$python" -c 'import json,sys; s=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(round(s["train_samples_per_s"]), round(s["test_accuracy"],4))')
  t3=$(now)
  wa=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b-a}'); wb=$(awk -v a="$t2" -v b="$t3" 'BEGIN {printf "%.2f", b-a}')
  echo "round $r: ddpjob ${a% *} samples/s (acc ${a#* }, ${wa} s)   torch ${b% *} samples/s (acc ${b#* }, ${wb} s)"
  ours+=("${a% *}"); theirs+=("${b% *}"); ours_wall+=("$wa"); theirs_wall+=("$wb")
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
mo=$(median "${ours[@]}"); mt=$(median "${theirs[@]}")
wo=$(median "${ours_wall[@]}"); wt=$(median "${theirs_wall[@]}")
echo "$model on $device, $nproc process(es) x $threads thread(s), medians: ddpjob $mo samples/s, torch $mt samples/s, ratio $(awk -v a="$mo" -v b="$mt" 'BEGIN {printf "%.2f", a/b}');" \
  "wall ddpjob $wo s, torch $wt s, ratio $(awk -v a="$wo" -v b="$wt" 'BEGIN {printf "%.2f", a/b}')"
