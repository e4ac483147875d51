#!/usr/bin/env bash
# All-reduce bandwidth side by side: `ddpjob bench allreduce` (tcp ring) and
# torch.distributed.all_reduce over gloo (bench/gloo_allreduce.py under torchrun), same sizes,
# same processes count, alternating ROUNDS times; prints each run and the median ratio per size.
#
#   bench/allreduce-vs-gloo.sh [NPROC] [SIZES] [ROUNDS]    e.g. bench/allreduce-vs-gloo.sh 2 1M,10M,100M 3
#
# Needs a release build and a Python with torch (TORCHRUN=/tmp/torchref/bin/torchrun, see
# ../shared/bench/README.md).
set -euo pipefail
nproc=${1:-2}; sizes=${2:-1M,10M,100M}; rounds=${3:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
torchrun=${TORCHRUN:-torchrun}
python=${PYTHON:-python3}
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
results=$(mktemp); trap 'rm -f "$results"' EXIT
for r in $(seq 1 "$rounds"); do
  echo "ddpjob $("$bin" bench allreduce --nproc-per-node "$nproc" --sizes "$sizes" --json)" >> "$results"
  echo "gloo $(OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc-per-node="$nproc" "$here/bench/gloo_allreduce.py" --sizes "$sizes" 2>/dev/null | tail -1)" >> "$results"
done
"$python" - "$results" "$nproc" <<'PY'
import json, statistics, sys
runs = {"ddpjob": [], "gloo": []}
for line in open(sys.argv[1]):
    who, _, text = line.partition(" ")
    runs[who].append(json.loads(text))
print(f"# all-reduce sum f32, {sys.argv[2]} processes, medians of {len(runs['ddpjob'])} alternating runs")
print(f"{'floats':>11} {'ddpjob ms':>10} {'gloo ms':>10} {'ddpjob busbw':>13} {'gloo busbw':>11} {'speed-up':>9}")
for i, row in enumerate(runs["ddpjob"][0]):
    ours = statistics.median(r[i]["time_ms"] for r in runs["ddpjob"])
    theirs = statistics.median(r[i]["time_ms"] for r in runs["gloo"])
    ob = statistics.median(r[i]["busbw_gbs"] for r in runs["ddpjob"])
    tb = statistics.median(r[i]["busbw_gbs"] for r in runs["gloo"])
    print(f"{row['floats']:>11} {ours:>10.3f} {theirs:>10.3f} {ob:>10.2f} GB/s {tb:>6.2f} GB/s {theirs / ours:>8.2f}x")
PY
