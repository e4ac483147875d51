#!/usr/bin/env bash
# The whole lecture recipe, end to end: `ddpjob run configs/fashion-mnist.toml` (20 epochs of
# the cnn, Adam lr 1e-2, L2 weight decay 1e-4, StepLR 0.5 per epoch, clip 0.1, accumulation 4)
# against bench/lecture_torch.py, the same recipe in plain PyTorch, one after the other on this
# machine with all its cores. Prints each epoch's samples/s and test accuracy side by side,
# then the whole-command wall times, final accuracies and ratios, and one JSON line.
#
#   PYTHON=/tmp/torchref/bin/python bench/lecture-vs-torch.sh
#   EPOCHS=9 IEEE=1 ... bench/lecture-vs-torch.sh   adds a ddpjob run with train.flush_denormals
#                                                   = false (IEEE subnormals), to see their cost
#   SKIP_TORCH=1 ...                                ddpjob only
#
# Needs: a release build (cargo build --release), Debian's dataset-fashion-mnist (or DATA=dir
# with the four IDX .gz files), a Python with torch and numpy (see ../shared/bench/README.md).
# 20 epochs take ddpjob minutes and PyTorch, which slows down on subnormals, most of an hour.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
data=${DATA:-/usr/share/datasets/fashion-mnist}
epochs=${EPOCHS:-20}
read -r -a bin <<< "${BIN:-$here/target/release/ddpjob}"
[ -x "${bin[-1]}" ] || { echo "no ${bin[-1]}: run cargo build --release first" >&2; exit 2; }
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "no Fashion-MNIST in $data: apt-get install dataset-fashion-mnist, or set DATA" >&2; exit 2; }
threads=$(nproc)
jobs=$(mktemp -d); trap 'rm -rf "$jobs"' EXIT
now() { date +%s.%N; }

echo "# $(lscpu | sed -n 's/^Model name: *//p'), $threads cores, AVX-512: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no); $epochs epochs"

# ddpjob NAME [--set ...]: the whole command, timed; leaves its job in $jobs/NAME.
ddpjob() {
  local name=$1; shift
  local t0; t0=$(now)
  "${bin[@]}" run "$here/configs/fashion-mnist.toml" --jobs-dir "$jobs" --name "$name" \
    --set "data.root=$data" --set train.epochs="$epochs" "$@" > "$jobs/$name.out"
  echo "$t0 $(now)" > "$jobs/$name.wall"
}
ddpjob ddpjob
[ -n "${IEEE:-}" ] && ddpjob ieee --set train.flush_denormals=false
if [ -z "${SKIP_TORCH:-}" ]; then
  t0=$(now)
  "$python" "$here/bench/lecture_torch.py" --threads "$threads" --epochs "$epochs" --data-dir "$data" > "$jobs/torch.jsonl"
  echo "$t0 $(now)" > "$jobs/torch.wall"
fi

"$python" - "$jobs" <<'PY'
import json, os, sys
jobs = sys.argv[1]
def wall(name):
    p = os.path.join(jobs, name + ".wall")
    if not os.path.exists(p):
        return None
    a, b = map(float, open(p).read().split())
    return b - a
def ddpjob_epochs(name):
    p = os.path.join(jobs, name, "metrics.jsonl")
    if not os.path.exists(p):
        return None
    rows = [json.loads(l) for l in open(p)]
    return [(r["samples_per_s"], r["test_accuracy"]) for r in rows if r.get("kind") == "epoch"]
runs = {n: ddpjob_epochs(n) for n in ("ddpjob", "ieee")}
torch_rows = None
if os.path.exists(os.path.join(jobs, "torch.jsonl")):
    lines = [json.loads(l) for l in open(os.path.join(jobs, "torch.jsonl"))]
    torch_rows = [(r["samples_per_s"], r["test_accuracy"]) for r in lines if "epoch" in r]
cols = [(n, r) for n, r in (("ddpjob", runs["ddpjob"]), ("ddpjob-ieee", runs["ieee"]), ("torch", torch_rows)) if r]
print("epoch " + " ".join(f"{n + ' samples/s':>22} {n + ' acc':>16}" for n, _ in cols))
for e in range(max(len(r) for _, r in cols)):
    cells = []
    for _, r in cols:
        cells.append(f"{r[e][0]:>22.0f} {100 * r[e][1]:>15.2f}%" if e < len(r) else " " * 39)
    print(f"{e + 1:>5} " + " ".join(cells))
report = {}
for n, r, w in (("ddpjob", runs["ddpjob"], wall("ddpjob")), ("ddpjob_ieee", runs["ieee"], wall("ieee")), ("torch", torch_rows, wall("torch"))):
    if not r:
        continue
    late = r[14] if len(r) >= 15 else r[-1]
    report[n] = {
        "wall_s": round(w, 1),
        "test_accuracy": r[-1][1],
        "epoch1_samples_per_s": round(r[0][0]),
        "late_epoch": min(15, len(r)),
        "late_samples_per_s": round(late[0]),
        "late_over_epoch1": round(late[0] / r[0][0], 3),
    }
    print(f"{n:>12}: wall {w:8.1f} s, final test accuracy {100 * r[-1][1]:.2f}%, "
          f"epoch {report[n]['late_epoch']} at {report[n]['late_over_epoch1']:.2f}x epoch 1's samples/s")
if "torch" in report:
    d = report["ddpjob"]; t = report["torch"]
    report["wall_ratio"] = round(d["wall_s"] / t["wall_s"], 3)
    report["accuracy_difference_points"] = round(100 * (d["test_accuracy"] - t["test_accuracy"]), 2)
    print(f"ddpjob / torch wall time: {report['wall_ratio']:.3f}; accuracy difference "
          f"{report['accuracy_difference_points']:+.2f} points")
print(json.dumps(report))
PY
