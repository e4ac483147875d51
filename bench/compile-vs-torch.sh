#!/usr/bin/env bash
# ddpjob against PyTorch with `torch.compile` (nanoGPT's GPU set-up: the model compiled, AdamW
# fused, the first 20 steps left out of its tokens/s), in one command, three cases:
#   gpt-recipe  configs/shakespeare-char-gpu.toml's sizes vs gpt_ref.py --bf16 --compile
#   gpt2-124m   GPT-2 124M's shape (12 layers, 12 heads, 768 channels, context 1024, batch 12,
#               the text's characters as vocabulary) vs gpt_ref.py --bf16 --compile
#   llama       a SmolLM2-135M-shaped llama (bench/llama_ref.py's) in bf16 vs transformers
#               with torch.compile (llama_ref.py train --compile --attn sdpa)
# each with both programs' training tokens/s and their ratio, the peak GPU memory (nvidia-smi's
# memory.used sampled every 0.1 s, the same way for both; on the CPU the peak RSS), and the
# model FLOPs utilisation: (6·N + 12·L·T·d) FLOPs a token (nanoGPT's estimate) × tokens/s over
# the GPU's dense bf16 peak (989 TFLOP/s for an H100 or H200 SXM; A100 312). Prints a line a
# case, then `compile: ...` with all three.
#
#   DEVICE=cuda BIN="target/gpu-dist/run-gpu.sh target/gpu-dist/ddpjob" bench/compile-vs-torch.sh
#   DEVICE=cpu TINY=1 STEPS=24 LLAMA_LAYERS=2 LLAMA_STEPS=24 LLAMA_BATCH=2 bench/compile-vs-torch.sh
#                       a dry run of the script on the CPU (inductor), the GPTs 2 x 2 x 64 at
#                       context 64, batch 4: what it prints is the script working, not figures
#
# env: CASES (default all three), STEPS (training steps of each program, default 300 for the
# GPTs; the llama LLAMA_STEPS, default 60), LLAMA_LAYERS (default 30), LLAMA_BATCH (default 32),
# TEXT, PYTHON (with torch; transformers for the llama), GPT_REF, BIN.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
python=${PYTHON:-python3}
device=${DEVICE:-cuda}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
gpt_ref=${GPT_REF:-$here/../shared/bench/gpt_ref.py}
read -r -a bin <<< "${BIN:-$here/target/release/ddpjob}"
cases=${CASES:-gpt-recipe gpt2-124m llama}
steps=${STEPS:-300}
lsteps=${LLAMA_STEPS:-60} layers=${LLAMA_LAYERS:-30} lbatch=${LLAMA_BATCH:-32}
[ -x "${bin[-1]}" ] || { echo "no ${bin[-1]}: build it (cargo build --release, or build-cuda.sh)" >&2; exit 2; }
[ -f "$text" ] || { echo "no $text: set TEXT" >&2; exit 2; }
[ -f "$gpt_ref" ] || { echo "no $gpt_ref: set GPT_REF" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
peak_flops=0
if [ "$device" = cuda ]; then
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | head -1)
  case "$gpu_name" in *H100*|*H200*) peak_flops=989e12 ;; *A100*) peak_flops=312e12 ;; esac
else gpu_name="CPU: $(lscpu | sed -n 's/^Model name: *//p')"; fi

# measured FILE CMD...: runs CMD; FILE gets its peak memory in MB (GPU memory used above what
# was in use before, or the process's peak RSS on the CPU).
measured() {
  local file=$1; shift
  if [ "$device" != cuda ]; then
    /usr/bin/time -f "%M" -o "$file.rss" "$@"; local status=$?
    awk '{printf "%.0f\n", $1 / 1024}' "$file.rss" > "$file"; return $status
  fi
  local base; base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | head -1)
  ( most=0; while :; do
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1)
      [ "${used:-0}" -gt "$most" ] && { most=$used; echo $((most - base)) > "$file"; }
      sleep 0.1
    done ) &
  local sampler=$!
  "$@"; local status=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  [ -s "$file" ] || echo 0 > "$file"
  return $status
}

# gpt CASE LAYERS HEADS EMBD BLOCK BATCH DROPOUT: both programs on the text's characters.
gpt() {
  local name=$1 l=$2 h=$3 d=$4 t=$5 b=$6 drop=$7
  local config=$work/$name.toml
  sed -e "s/^n_layer *=.*/n_layer = $l/" -e "s/^n_head *=.*/n_head = $h/" \
      -e "s/^n_embd *=.*/n_embd = $d/" -e "s/^block_size *=.*/block_size = $t/" \
      -e "s/^batch_size *=.*/batch_size = $b/" -e "s/^max_steps *=.*/max_steps = $steps/" \
      -e "s/^dropout *=.*/dropout = $drop/" configs/shakespeare-char-gpu.toml > "$config"
  local precision=(--set train.precision=bf16); [ "$device" = cpu ] && precision=()
  measured "$work/$name-ours.mem" "${bin[@]}" run "$config" --jobs-dir "$work/jobs" --name "$name" \
    --set "data.path=$text" --set data.download=false --set "distributed.device=$device" \
    --set expect.max_wall_s=1e9 "${precision[@]}" > "$work/$name-ours.log" 2>&1
  local bf16=(--bf16); [ "$device" = cpu ] && bf16=(--threads "$(nproc)")
  measured "$work/$name-ref.mem" "$python" "$gpt_ref" --text "$text" --device "$device" --compile \
    "${bf16[@]}" --n-layer "$l" --n-head "$h" --n-embd "$d" --block-size "$t" --batch-size "$b" \
    --max-steps "$steps" --dropout "$drop" 2> "$work/$name-ref.err" | tail -1 > "$work/$name-ref.json"
  report "$name" "$l" "$t" "$d" "$work/jobs/$name/summary.json" "$work/$name-ref.json"
}

# report CASE LAYERS CONTEXT WIDTH SUMMARY REF_JSON: the case's line.
report() {
  "$python" - "$@" "$work/$1-ours.mem" "$work/$1-ref.mem" "$peak_flops" <<'PY'
import json, sys
name, layers, t, d, summary, ref, ours_mem, ref_mem, peak = sys.argv[1:10]
layers, t, d, peak = int(layers), int(t), int(d), float(peak)
s, r = json.load(open(summary)), json.loads(open(ref).read().strip().splitlines()[-1])
ours, theirs = s["train_tokens_per_s"], r.get("tokens_per_s", r.get("train_tokens_per_s"))
def mfu(tokens, n):
    if not peak:
        return "n/a"
    return f"{100 * (6 * n + 12 * layers * t * d) * tokens / peak:.1f}%"
mem = [open(f).read().strip() for f in (ours_mem, ref_mem)]
loss = ""
if "val_loss" in r:
    loss = f", val loss {s['test_loss']:.4f} vs {r['val_loss']:.4f}"
print(f"{name}: ddpjob {ours:.0f} tokens/s, torch.compile {theirs:.0f}: {ours / theirs:.2f}x; "
      f"peak memory {mem[0]} MB vs {mem[1]} MB; MFU {mfu(ours, s['parameters'])} vs "
      f"{mfu(theirs, r['parameters'])}{loss}")
PY
}

llama() {
  local lwork=$work/llama
  "$python" bench/llama_ref.py prepare "$lwork" "$text" --layers "$layers" > "$work/llama-prepare.log" 2>&1 \
    || { echo "llama: prepare failed: $(tail -2 "$work/llama-prepare.log")"; return 1; }
  local precision=bf16; [ "$device" = cpu ] && precision=f32
  measured "$work/llama-ours.mem" "${bin[@]}" run "$lwork/job.toml" --jobs-dir "$work/jobs" --name llama \
    --set "distributed.device=$device" --set "train.precision=$precision" \
    --set "train.batch_size=$lbatch" --set "train.max_steps=$lsteps" > "$work/llama-ours.log" 2>&1
  measured "$work/llama-ref.mem" "$python" bench/llama_ref.py train "$lwork" --steps "$lsteps" \
    --device "$device" --precision "$precision" --attn sdpa --batch "$lbatch" --threads "$(nproc)" \
    --compile 2> "$work/llama-ref.err" | tail -1 > "$work/llama-ref.json"
  local hidden; hidden=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["hidden_size"])' "$lwork/model/config.json")
  local nlayers; nlayers=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$lwork/model/config.json")
  report llama "$nlayers" 256 "$hidden" "$work/jobs/llama/summary.json" "$work/llama-ref.json"
}

echo "# compile-vs-torch on $gpu_name, device $device"
lines=()
for c in $cases; do
  case $c in
    gpt-recipe) sizes=(6 6 384 256 64 0.2) ;;&
    gpt2-124m) sizes=(12 12 768 1024 12 0.0) ;;&
    gpt-recipe|gpt2-124m)
      [ -n "${TINY:-}" ] && sizes=(2 2 64 64 4 0.0)
      line=$(gpt "$c" "${sizes[@]}" 2>&1) ;;
    llama) line=$(llama 2>&1) ;;
    *) echo "unknown case $c: gpt-recipe, gpt2-124m, llama" >&2; exit 2 ;;
  esac
  line=${line:-"$c: failed: $(tail -2 "$work/$c-ours.log" "$work/$c-ref.err" 2>/dev/null | tr '\n' ' ')"}
  echo "$line"; lines+=("$line")
done
printf 'compile: %s\n' "$(IFS='|'; echo "${lines[*]}" | sed 's/|/; /g')"
