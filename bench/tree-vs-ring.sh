#!/usr/bin/env bash
# The tree-ordered all-reduce of world-size-invariant training against the ring every other job
# uses: `ddpjob bench allreduce --algorithm tree` and `--algorithm ring`, same sizes, same process
# count, alternating ROUNDS times; prints the median time and bus bandwidth of each per size and
# the tree's bandwidth as a fraction of the ring's.
#
#   bench/tree-vs-ring.sh [NPROC] [SIZES] [ROUNDS]    e.g. bench/tree-vs-ring.sh 4 1M,10M,50M 5
#
# Needs a release build (cargo build --release). NPROC: a power of two.
set -euo pipefail
nproc=${1:-4}; sizes=${2:-1M,10M,50M}; rounds=${3:-5}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
python=${PYTHON:-python3}
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
results=$(mktemp); trap 'rm -f "$results"' EXIT
for r in $(seq 1 "$rounds"); do
  for algorithm in ring tree; do
    echo "$algorithm $("$bin" bench allreduce --device cpu --nproc-per-node "$nproc" --sizes "$sizes" --algorithm "$algorithm" --json)" >> "$results"
  done
done
"$python" - "$results" "$nproc" <<'PY'
import json, statistics, sys
runs = {"ring": [], "tree": []}
for line in open(sys.argv[1]):
    who, _, text = line.partition(" ")
    runs[who].append(json.loads(text))
print(f"# all-reduce f32 (ring: average, tree: sum, as training calls them), {sys.argv[2]} processes, medians of {len(runs['ring'])} alternating runs")
print(f"{'floats':>11} {'ring ms':>9} {'tree ms':>9} {'ring busbw':>11} {'tree busbw':>11} {'tree/ring':>10}")
for i, row in enumerate(runs["ring"][0]):
    ring = statistics.median(r[i]["time_ms"] for r in runs["ring"])
    tree = statistics.median(r[i]["time_ms"] for r in runs["tree"])
    rb = statistics.median(r[i]["busbw_gbs"] for r in runs["ring"])
    tb = statistics.median(r[i]["busbw_gbs"] for r in runs["tree"])
    print(f"{row['floats']:>11} {ring:>9.3f} {tree:>9.3f} {rb:>6.2f} GB/s {tb:>6.2f} GB/s {ring / tree:>9.2f}x")
PY
