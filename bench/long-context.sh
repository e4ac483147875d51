#!/usr/bin/env bash
# Long contexts on the CPU: `ddpjob bench step` of bench/long-context.toml's llama (4 layers of
# 512, 8 heads of 64 over 2 key-value heads), 1 process x all cores, random batches, AdamW:
#   - training tokens/s at context 1024 (batch 4) and 4096 (batch 1), this build and, with
#     BEFORE=path/to/an/older/ddpjob, that one beside it (the ratio new / old);
#   - peak RSS of 8192 x 1 against 2048 x 4 (the same tokens a step; attention in tiles keeps
#     it linear in the context), and of a 151,936-token vocabulary against 1,024 at 2048 x 2,
#     with the parameters' share from `ddpjob validate`'s estimate beside it.
#
#   bench/long-context.sh            STEPS=3 (timed steps after one warm-up)
#
# Needs a release build (cargo build --release). Figures: docs/src/performance-llama.md.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN:-$here/target/release/ddpjob}
before=${BEFORE:-}
steps=${STEPS:-3}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
config=$here/bench/long-context.toml
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
[ -f "$text" ] || { echo "no $text: set TEXT" >&2; exit 2; }
lscpu | sed -n 's/^Model name: *//p'
echo "threads: $(nproc)"

# step BIN CONTEXT BATCH [VOCAB]: "median-ms peak-MB"
step() {
  local b=$1 t=$2 n=$3 v=${4:-}
  local sets=(--set data.path="$text" --set model.block_size="$t" --set train.batch_size="$n")
  [ -n "$v" ] && sets+=(--set model.vocab_size="$v")
  local out peak
  out=$( { /usr/bin/time -f "peak-kb %M" "$b" bench step --config "$config" "${sets[@]}" \
    --steps "$steps" --warmup 1 --no-peak --json; } 2>&1 )
  peak=$(sed -n 's/^peak-kb //p' <<<"$out")
  python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["step_ms_median"], int(sys.argv[2])//1024)' \
    "$(grep '^{' <<<"$out")" "$peak"
}

# estimate CONTEXT BATCH VOCAB: the estimate's weights + gradients + optimizer, in GB.
estimate() {
  "$bin" validate "$config" --set data.path="$text" --set model.block_size="$1" \
    --set train.batch_size="$2" --set model.vocab_size="$3" 2>/dev/null |
    sed -n 's/.*weights \([0-9.]*\) GB, gradients \([0-9.]*\) GB, optimizer \([0-9.]*\) GB.*/\1 \2 \3/p' |
    awk '{ print $1 + $2 + $3 }'
}

echo
echo "| context x batch | tokens/s this build | tokens/s BEFORE | ratio | peak MB |"
echo "|---|---|---|---|---|"
for shape in "1024 4" "4096 1"; do
  set -- $shape
  read -r ms peak < <(step "$bin" "$1" "$2")
  tokens=$(( $1 * $2 ))
  now=$(python3 -c "print(round($tokens / ($ms / 1000)))")
  if [ -n "$before" ]; then
    read -r bms _ < <(step "$before" "$1" "$2")
    old=$(python3 -c "print(round($tokens / ($bms / 1000)))")
    ratio=$(python3 -c "print(f'{$bms / $ms:.2f}x')")
  else old=-; ratio=-; fi
  echo "| $1 x $2 | $now | $old | $ratio | $peak |"
done

echo
read -r _ short < <(step "$bin" 2048 4)
read -r _ long < <(step "$bin" 8192 1)
echo "peak RSS, the same 8,192 tokens a step: 8192 x 1 $long MB, 2048 x 4 $short MB: $(python3 -c "print(f'{$long / $short:.2f}x')")"

read -r _ small < <(step "$bin" 2048 2 1024)
read -r _ large < <(step "$bin" 2048 2 151936)
share=$(python3 -c "print(round(($(estimate 2048 2 151936) - $(estimate 2048 2 1024)) * 1000))")
echo "peak RSS at 2048 x 2, vocabulary 151,936 against 1,024: +$(( large - small )) MB; the parameters' share (weights, gradients, AdamW, as the estimate counts them): $share MB; beyond it: $(( large - small - share )) MB"
