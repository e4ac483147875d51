#!/usr/bin/env bash
# `distributed.overlap_comm` side by side: the 85 M-parameter GPT of bench/zero-memory.sh
# (12 layers x 768, context 256, AdamW, batch 1) with `sharding = "full"` on W CPU workers,
# its collectives inline and overlapping the passes, alternated ROUNDS times. Prints s/step
# (train_s / steps) and each rank's peak RSS.
#
#   bench/zero-overlap.sh [W]          (default 2)
#   LINK=2gbit bench/zero-overlap.sh   loopback shaped to that rate (tc tbf; root, and the
#                                      shaping removed on exit): collectives that wait on a
#                                      network, as between nodes
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
w=${1:-2}
lscpu | sed -n 's/^Model name: *//p'
out=$(mktemp -d)
cleanup() {
  rm -rf "$out"
  [ -z "${LINK:-}" ] || tc qdisc del dev lo root 2>/dev/null || true
}
trap cleanup EXIT
if [ -n "${LINK:-}" ]; then
  tc qdisc add dev lo root tbf rate "$LINK" burst 256kb latency 50ms
  echo "loopback shaped to $LINK"
fi
cat > "$out/gpt.toml" <<EOT
seed = 1
[model]
arch = "gpt"
n_layer = ${LAYERS:-12}
n_head = 12
n_embd = 768
bias = false
block_size = 256
[data]
dataset = "text"
path = "$text"
tokenizer = "char"
[train]
max_steps = ${STEPS:-6}
batch_size = 1
lr = 1e-4
optimizer = "adamw"
eval_batches = 1
eval_batch_size = 1
log_every = 1
[checkpoint]
every_epochs = 0
[distributed]
sharding = "full"
EOT
printf '%-3s %-13s %8s %s\n' W overlap_comm s/step "peak RSS MB per rank"
for round in $(seq "${ROUNDS:-2}"); do
  for overlap in false true; do
    name=r$round-$overlap
    "$bin" run "$out/gpt.toml" --jobs-dir "$out/jobs" --name "$name" --nproc-per-node "$w" \
      --set "distributed.overlap_comm=$overlap" > "$out/$name.log" 2>&1 \
      || { cat "$out/$name.log" >&2; exit 1; }
    python3 - "$out/jobs/$name/summary.json" "$w" "$overlap" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
peaks = " ".join(f"{b / 1e6:.0f}" for b in s["peak_rss_bytes"])
print(f"{sys.argv[2]:<3} {sys.argv[3]:<13} {s['train_s'] / s['steps']:>8.2f} {peaks}")
PY
  done
done
