#!/usr/bin/env bash
# QLoRA against LoRA on the CPU: `ddpjob bench step` of bench/qlora.toml's llama
# (SmolLM2-135M's shape, LoRA r 16 on all seven projections), 1 process x all cores, random
# batches, AdamW, once over the f32 base and once with [model.quantize] (NF4, blocks of 64,
# double quantisation): median step time and peak RSS of each, and their ratios.
#
#   bench/qlora.sh            STEPS=3 (timed steps after one warm-up), BATCHES="1 2", CONTEXT=512
#
# Needs a release build (cargo build --release). Figures: docs/src/fine-tuning.md ("QLoRA").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN:-$here/target/release/ddpjob}
steps=${STEPS:-3}
batches=${BATCHES:-1 2}
context=${CONTEXT:-512}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
config=$here/bench/qlora.toml
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
[ -f "$text" ] || { echo "no $text: set TEXT" >&2; exit 2; }
lscpu | sed -n 's/^Model name: *//p'
echo "threads: $(nproc); $context positions"

# step [--set ...]: "median-ms peak-MB"
step() {
  local out peak
  out=$( { /usr/bin/time -f "peak-kb %M" "$bin" bench step --config "$config" \
    --set data.path="$text" --set train.batch_size="$batch" --set model.block_size="$context" \
    "$@" --steps "$steps" --warmup 1 --no-peak --json; } 2>&1 )
  peak=$(sed -n 's/^peak-kb //p' <<<"$out")
  python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["step_ms_median"], int(sys.argv[2])//1024)' \
    "$(grep '^{' <<<"$out")" "$peak"
}

echo
echo "| batch | step ms LoRA | step ms QLoRA | ratio | peak RSS MB LoRA | peak RSS MB QLoRA | ratio |"
echo "|---|---|---|---|---|---|---|"
for batch in $batches; do
  read -r lms lpeak < <(step)
  read -r qms qpeak < <(step --set model.quantize.bits=4 --set model.quantize.double_quant=true)
  echo "| $batch x $context | $(printf %.0f "$lms") | $(printf %.0f "$qms") |" \
    "$(python3 -c "print(f'{$qms / $lms:.2f}x')") | $lpeak | $qpeak |" \
    "$(python3 -c "print(f'{$qpeak / $lpeak:.3f}x')") |"
done
