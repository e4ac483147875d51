#!/usr/bin/env bash
# Side-by-side language-model training: `ddpjob run configs/shakespeare-char.toml` vs
# ../shared/bench/gpt_ref.py (the same GPT and nanoGPT's CPU recipe in PyTorch), alternating the
# two programs ROUNDS times. Prints each run's validation loss, training tokens/s and
# whole-command wall time, then medians and the ratios ddpjob / torch.
#
#   bench/gpt-vs-torch.sh [ROUNDS]               1 process x all cores
#   NPROC=2 bench/gpt-vs-torch.sh 1              2 workers x 1 thread vs torchrun 2 x 1 thread
#                                                (gloo DDP); global batch 12 either way
#   DEVICE=cuda BIN=target/gpu-dist/run-gpu.sh\ target/gpu-dist/ddpjob CONFIG=configs/shakespeare-char-gpu.toml \
#     bench/gpt-vs-torch.sh 1                    on a GPU: the GPU recipe vs gpt_ref.py --device cuda
#
# Needs: a release build (cargo build --release), the text (TEXT, default
# ../shared/data/tinyshakespeare/input.txt) and a Python with torch (see ../shared/bench/README.md).
set -euo pipefail
rounds=${1:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
nproc=${NPROC:-1}
torchrun=${TORCHRUN:-$(dirname "$python")/torchrun}
gpt_ref=${GPT_REF:-$here/../shared/bench/gpt_ref.py}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
config=${CONFIG:-$here/configs/shakespeare-char.toml}
device=${DEVICE:-cpu}
read -r -a bin <<< "${BIN:-$here/target/release/ddpjob}"   # may be a wrapper and the binary
[ -x "${bin[-1]}" ] || { echo "no ${bin[-1]}: run cargo build --release first" >&2; exit 2; }
[ -f "$gpt_ref" ] || { echo "no $gpt_ref: set GPT_REF" >&2; exit 2; }
[ -f "$text" ] || { echo "no $text: set TEXT" >&2; exit 2; }
jobs=$(mktemp -d); trap 'rm -rf "$jobs"' EXIT

# The recipe's numbers, read from the job file so both programs train the same thing.
read -r layers heads embd block batch steps dropout < <("$python" - "$config" <<'EOF'
import sys, tomllib
c = tomllib.load(open(sys.argv[1], "rb")); m, t = c["model"], c["train"]
print(m["n_layer"], m["n_head"], m["n_embd"], m["block_size"], t["batch_size"], t["max_steps"], m.get("dropout", 0.0))
EOF
)
threads=$(( $(nproc) / nproc )); [ "$threads" -ge 1 ] || threads=1
per_rank=$(( batch / nproc ))
torch_args=(--text "$text" --n-layer "$layers" --n-head "$heads" --n-embd "$embd" --block-size "$block"
            --batch-size "$per_rank" --max-steps "$steps" --dropout "$dropout")
if [ "$device" = cuda ]; then torch_args+=(--device cuda --bf16); else torch_args+=(--threads "$threads"); fi
if [ "$nproc" -gt 1 ]; then
  torch_cmd=("$torchrun" --standalone --nproc-per-node="$nproc" "$gpt_ref")
else
  torch_cmd=("$python" "$gpt_ref")
fi
now() { date +%s.%N; }
ours=(); theirs=(); ours_wall=(); theirs_wall=(); ours_loss=(); theirs_loss=()
for r in $(seq 1 "$rounds"); do
  t0=$(now)
  "${bin[@]}" run "$config" --jobs-dir "$jobs" --name "bench-$r" --set "data.path=$text" \
    --set data.download=false --set train.batch_size="$per_rank" --set distributed.device="$device" \
    --nproc-per-node "$nproc" > /dev/null 2>&1 || true   # [expect] may fail; the figures still count
  t1=$(now)
  a=$("$python" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(round(s["train_tokens_per_s"]), round(s["test_loss"],4))' "$jobs/bench-$r/summary.json")
  t2=$(now)
  b=$(OMP_NUM_THREADS=$threads "${torch_cmd[@]}" "${torch_args[@]}" 2>/dev/null \
      | "$python" -c 'import json,sys; s=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(round(s["tokens_per_s"]), round(s["val_loss"],4))')
  t3=$(now)
  wa=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b-a}'); wb=$(awk -v a="$t2" -v b="$t3" 'BEGIN {printf "%.1f", b-a}')
  echo "round $r: ddpjob ${a% *} tokens/s (val loss ${a#* }, ${wa} s)   torch ${b% *} tokens/s (val loss ${b#* }, ${wb} s)"
  ours+=("${a% *}"); theirs+=("${b% *}"); ours_wall+=("$wa"); theirs_wall+=("$wb")
  ours_loss+=("${a#* }"); theirs_loss+=("${b#* }")
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
mo=$(median "${ours[@]}"); mt=$(median "${theirs[@]}")
wo=$(median "${ours_wall[@]}"); wt=$(median "${theirs_wall[@]}")
echo "gpt $layers layers x $embd channels on $device, $nproc process(es) x $threads thread(s), medians:" \
  "ddpjob $mo tokens/s (val loss $(median "${ours_loss[@]}")), torch $mt tokens/s (val loss $(median "${theirs_loss[@]}")), ratio $(awk -v a="$mo" -v b="$mt" 'BEGIN {printf "%.2f", a/b}');" \
  "wall ddpjob $wo s, torch $wt s, ratio $(awk -v a="$wo" -v b="$wt" 'BEGIN {printf "%.2f", a/b}')"
