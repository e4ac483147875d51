#!/usr/bin/env bash
# LoRA on SmolLM2-135M's shape (the directory of bench/llama-vs-transformers.sh, random weights),
# 1 process x all cores, r 16, alpha 32 on all seven projections: ddpjob's training step time
# and peak RSS beside its own full fine-tuning of the same model and batch (`ddpjob bench
# step`), and its tokens/s beside transformers + peft doing the same LoRA training (median step
# after two). Alternates the programs ROUNDS times; prints medians and the ratios.
#
#   bench/lora-vs-peft.sh [ROUNDS]        LAYERS=2 for a quick check of the set-up
#
# Needs: a release build and a Python with torch, transformers, tokenizers and peft (PYTHON).
set -euo pipefail
rounds=${1:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
layers=${LAYERS:-30}
steps=${STEPS:-8}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
work=${WORK:-/tmp/llama-bench-$layers}
bin=$here/target/release/ddpjob
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
threads=$(nproc)
if [ ! -f "$work/job.toml" ]; then
  "$python" "$here/bench/llama_ref.py" prepare "$work" "$text" --layers "$layers" > /dev/null 2>&1
fi
lscpu | sed -n 's/^Model name: *//p'
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
lora=(--set model.lora.r=16 --set model.lora.alpha=32
      --set 'model.lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]')
for r in $(seq 1 "$rounds"); do
  for kind in full lora; do
    extra=(); [ "$kind" = lora ] && extra=("${lora[@]}")
    /usr/bin/time -f "%M" -o "$out/$kind-$r.rss" "$bin" bench step --config "$work/job.toml" \
      --steps "$steps" --warmup 2 --json "${extra[@]}" 2> /dev/null | tail -1 > "$out/$kind-$r.json"
  done
  OMP_NUM_THREADS=$threads "$python" "$here/bench/llama_ref.py" train "$work" --steps $((steps + 2)) \
    --threads "$threads" --lora 16 2> /dev/null | tail -1 > "$out/peft-$r.json"
done
"$python" - "$out" "$rounds" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
block = 256
col = {k: [] for k in ["full_ms", "lora_ms", "full_rss", "lora_rss", "lora_tps", "peft_tps"]}
for r in range(1, rounds + 1):
    for kind in ["full", "lora"]:
        bench = json.load(open(out / f"{kind}-{r}.json"))
        col[f"{kind}_ms"].append(bench["step_ms_median"])
        col[f"{kind}_rss"].append(int(open(out / f"{kind}-{r}.rss").read().split()[-1]) / 1e6)
        if kind == "lora":
            col["lora_tps"].append(bench["samples_per_s"] * block)
    col["peft_tps"].append(json.load(open(out / f"peft-{r}.json"))["train_tokens_per_s"])
m = {k: statistics.median(v) for k, v in col.items()}
print(f"{'':34}{'LoRA':>10}{'full':>10}{'ratio':>8}")
print(f"{'ddpjob step ms (bench step)':34}{m['lora_ms']:10.0f}{m['full_ms']:10.0f}{m['lora_ms'] / m['full_ms']:8.2f}")
print(f"{'ddpjob peak RSS GB':34}{m['lora_rss']:10.2f}{m['full_rss']:10.2f}{m['lora_rss'] / m['full_rss']:8.2f}")
print(f"{'':34}{'ddpjob':>10}{'peft':>10}{'ratio':>8}")
print(f"{'LoRA training tokens/s':34}{m['lora_tps']:10.0f}{m['peft_tps']:10.0f}{m['lora_tps'] / m['peft_tps']:8.2f}")
PY
