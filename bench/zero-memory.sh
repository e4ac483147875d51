#!/usr/bin/env bash
# Memory that shrinks as workers are added: a GPT of 12 layers x 768 (85 M parameters, context
# 256, the tiny Shakespeare's characters), AdamW, trained a few steps by W CPU workers with
# `distributed.sharding` "none", "optimizer" (ZeRO-1), "gradients" (ZeRO-2) and "full"
# (ZeRO-3), side by side in one run. Prints each rank's peak RSS (summary.json's
# `peak_rss_bytes`) beside the estimate (`estimated_peak_bytes`), each mode's saving per worker
# over the one before it beside the expected share ((1 - 1/W) x 8 bytes x parameters for the
# optimizer's moments, (1 - 1/W) x 4 bytes x parameters for the gradients, and again for the
# weights, less the blocks gathered at a time), and the step time of each. "full-overlap" is
# "full" with `distributed.overlap_comm = true`: the collectives on a thread of their own, the
# next block gathered ahead, beside "full"'s, each run when the pass asks.
#
#   bench/zero-memory.sh [W ...]        (default: 2 4)   LAYERS=2 for a quick check
#   MODEL=llama bench/zero-memory.sh    a llama of the same size (12 x 768, SwiGLU 2048, 85 M),
#                                       whose "gradients" and "full" run the same pass
#
# Checkpoints are off unless CHECKPOINT_EVERY=N (steps): rank 0 then writes the whole
# optimizer state, streamed bucket by bucket when it is sharded.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
layers=${LAYERS:-12}
steps=${STEPS:-4}
worlds=("${@:-2}")
[ $# -gt 0 ] || worlds=(2 4)
lscpu | sed -n 's/^Model name: *//p'
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
case ${MODEL:-gpt} in
  gpt) model="arch = \"gpt\"
n_layer = $layers
n_head = 12
n_embd = 768
bias = false" ;;
  llama) model="arch = \"llama\"
hidden_size = 768
intermediate_size = 2048
num_hidden_layers = $layers
num_attention_heads = 12
num_key_value_heads = 12" ;;
  *) echo "MODEL is gpt or llama" >&2; exit 2 ;;
esac
cat > "$out/gpt.toml" <<EOF
seed = 1
[model]
$model
block_size = 256
[data]
dataset = "text"
path = "$text"
tokenizer = "char"
[train]
max_steps = $steps
batch_size = 1
lr = 1e-4
optimizer = "adamw"
weight_decay = 0.1
grad_clip_norm = 1.0
eval_batches = 1
eval_batch_size = 1
log_every = 1
[checkpoint]
every_epochs = 0
every_steps = ${CHECKPOINT_EVERY:-0}
EOF
printf '%-3s %-11s %12s %14s %14s %12s %10s\n' W sharding "params" "peak RSS MB" "(per rank)" \
  "estimate MB" "s/step"
for w in "${worlds[@]}"; do
  for mode in none optimizer gradients full full-overlap; do
    name=w$w-$mode
    overlap=false; [ "$mode" = full-overlap ] && overlap=true
    "$bin" run "$out/gpt.toml" --jobs-dir "$out/jobs" --name "$name" --nproc-per-node "$w" \
      --set "distributed.sharding=\"${mode%-overlap}\"" \
      --set "distributed.overlap_comm=$overlap" > "$out/$name.log" 2>&1 \
      || { cat "$out/$name.log" >&2; exit 1; }
    python3 - "$out/jobs/$name/summary.json" "$w" "$mode" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
peaks = [b / 1e6 for b in s["peak_rss_bytes"]]
per_step = s["train_s"] / s["steps"]
if "estimated_peak_bytes" in s:
    estimate = s["estimated_peak_bytes"] / 1e6
    estimate = f"{estimate:>7.0f} ({(estimate / max(peaks) - 1) * 100:+.0f}%)"
else:
    estimate = "not known"
print(f"{sys.argv[2]:<3} {sys.argv[3]:<11} {s['parameters']:>12} {max(peaks):>14.0f} "
      f"{' '.join(f'{p:.0f}' for p in peaks):>14} {estimate:>14} {per_step:>10.2f}")
PY
  done
  for pair in "none optimizer 8" "optimizer gradients 4" "gradients full 4"; do
    set -- $pair
    python3 - "$out/jobs/w$w-$1/summary.json" "$out/jobs/w$w-$2/summary.json" "$w" "$3" "$1" "$2" <<'PY'
import json, sys
a, b, w, per = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
saved = [(x - y) / 1e6 for x, y in zip(a["peak_rss_bytes"], b["peak_rss_bytes"])]
expected = (1 - 1 / w) * per * a["parameters"] / 1e6
mean = sum(saved) / len(saved)
print(f"    W={w}, {sys.argv[5]} -> {sys.argv[6]}: saved per worker "
      f"{' '.join(f'{s:.0f}' for s in saved)} MB (mean {mean:.0f}); expected (1 - 1/W) x {per} B "
      f"x params = {expected:.0f} MB; ratio {mean / expected:.2f}")
PY
  done
done
