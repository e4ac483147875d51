#!/usr/bin/env bash
# Activation checkpointing: a GPT of 12 layers x 768 (85 M parameters, the tiny Shakespeare's
# characters) at context 1024, one process x all cores, AdamW, batch B: `ddpjob bench step`'s
# median step time and the process's peak RSS, with `train.activation_checkpointing` off and
# on, alternated ROUNDS times; prints medians and the ratios.
#
#   bench/activation-checkpointing.sh [ROUNDS] [BATCH]     (default: 2 rounds, batch 4)
#   LAYERS=2 for a quick check
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
rounds=${1:-2}
batch=${2:-4}
layers=${LAYERS:-12}
steps=${STEPS:-3}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
lscpu | sed -n 's/^Model name: *//p'
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
cat > "$out/gpt.toml" <<EOF2
seed = 1
[model]
arch = "gpt"
n_layer = $layers
n_head = 12
n_embd = 768
block_size = 1024
bias = false
[data]
dataset = "text"
path = "$text"
tokenizer = "char"
[train]
batch_size = $batch
optimizer = "adamw"
grad_clip_norm = 1.0
EOF2
for r in $(seq 1 "$rounds"); do
  for on in false true; do
    /usr/bin/time -f "%M" -o "$out/$on-$r.rss" "$bin" bench step --config "$out/gpt.toml" \
      --steps "$steps" --warmup 1 --json --set "train.activation_checkpointing=$on" \
      2> "$out/$on-$r.err" | tail -1 > "$out/$on-$r.json" || { cat "$out/$on-$r.err" >&2; exit 1; }
  done
done
python3 - "$out" "$rounds" "$batch" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rounds, batch = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
col = {}
for on in ("false", "true"):
    col[on] = (
        [json.loads((out / f"{on}-{r}.json").read_text())["step_ms_median"] for r in range(1, rounds + 1)],
        [int((out / f"{on}-{r}.rss").read_text().split()[-1]) / 1e6 for r in range(1, rounds + 1)],
    )
m = {on: (statistics.median(ms), statistics.median(gb)) for on, (ms, gb) in col.items()}
print(f"batch {batch} x 1024 tokens   {'off':>10} {'on':>10} {'on/off':>8}")
print(f"step ms (median)      {m['false'][0]:10.0f} {m['true'][0]:10.0f} {m['true'][0] / m['false'][0]:8.2f}")
print(f"peak RSS GB           {m['false'][1]:10.2f} {m['true'][1]:10.2f} {m['true'][1] / m['false'][1]:8.2f}")
PY
