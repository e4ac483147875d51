#!/usr/bin/env bash
# Checks ddpjob on a GPU machine (no network, no Rust there): the CUDA binary from
# ../shared/gpu/build-cuda.sh and data carried in the tree. Prints a table and writes, after
# every step, gpu-check.json (steps, status, details) and logs.tar.gz (every step's output) to
# $OUT (the device tool brings $OUT back: at most 8 files; this writes 4), else a temp folder.
#
#   bench/gpu-check.sh [STEP...]            on the GPU machine, from the repository root, with
#                                           target/gpu-carry/ from bench/gpu-pack.sh carried
#                                           (device tool: carry ["target/gpu-carry"])
#   DEVICE=cpu bench/gpu-check.sh           the same steps on this machine's CPU (a dry run of
#                                           the script itself; GPU-only steps are skipped)
#
# STEPs (default: all, in this order): driver (nvidia-smi, the libraries the binary loads),
# warmup (the kernels each job below uses, loaded once before anything is timed: the driver
# compiles candle's PTX at first load and caches it; its seconds are reported),
# kernels (the library's GPU tests, from the unit tests gpu-pack.sh packs: each ddpjob kernel
# against its host reference, the dropout masks bit for bit), smoke (configs/smoke.toml in f32
# and bf16 with --junit), nccl (NCCL at world size 1 with its collectives exercised, against the
# same GPU job without them: bit-identical weights), tcp2 (two workers sharing the GPU over the
# tcp backend, against one worker with both batches), memory (`validate` compares a worker's
# memory estimate with the GPU's free memory; `run` refuses a GPT of 11 B parameters, exit 2,
# before creating its job), zero (`distributed.sharding = "full"` against `"gradients"`, bit
# for bit: two workers sharing the GPU over tcp, and one through NCCL with its collectives
# exercised: parameters gathered into device storage and let go of), recompute (the GPT recipe
# with `train.activation_checkpointing` against the same job without it, bit for bit), cnn (a Fashion-MNIST cnn epoch against
# torch_ref.py), gpt (the GPT GPU recipe against gpt_ref.py), llama (a SmolLM2-135M-shaped
# `llama` from a Hugging Face directory, bf16, against transformers on the same device: training
# and `eval` tokens/s, the first steps' losses), compile (the GPT recipe, GPT-2 124M's shape and
# the llama against torch.compile: tokens/s, peak GPU memory, MFU; COMPILE_STEPS, default 300),
# bench (`bench step` of BENCH_CONFIG and of the step the cnn
# epoch runs, `bench allreduce`),
# profile (ncu's time per kernel of the GPT recipe's step and the cnn's), resume (SIGTERM in the middle of a
# run, then `resume`, against the same job uninterrupted). The device tool
# stops a command after 10 minutes: every step took about 3 minutes on an H200 (500 GPT steps
# of each program by default; GPT_STEPS=all runs the recipe's 5000, which fits STEP_TIMEOUT
# only if a step of each takes under ~50 ms).
#
# env: BIN (default: target/gpu-carry's binary, else "target/gpu-dist/run-gpu.sh
#      target/gpu-dist/ddpjob"), DATA (the four Fashion-MNIST .gz files; default
#      target/gpu-carry/fashion-mnist), TEXT (default target/gpu-carry/input.txt), PYTHON (with
#      torch), QUICK=1 (200 GPT steps), GPT_STEPS=N (N GPT steps, default 500; "all": the
#      recipe's), LLAMA_LAYERS (default 30), LLAMA_STEPS (default 40), LLAMA_BATCH (default 32
#      windows of 256 tokens), PROFILE_MODEL (the models profiled, default "gpt cnn": the GPT
#      recipe's step and the cnn's at batch 64 as the `cnn` step runs it; "llama": the llama
#      step's model and batch, bf16), PROFILE_LAUNCHES (kernels ncu times, default 4000;
#      12000 for llama, 3000 for the cnn),
#      STEP_TIMEOUT (seconds each command of a step may take, default 540), SMOKE_ONLY=1 (skip
#      cnn and gpt, which need PyTorch and data: what CI's GPU job runs), BENCH_CONFIG (the job
#      file `bench step` times, default configs/fashion-mnist.toml), ALLREDUCE_SIZES (default
#      1M,10M,100M).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
all_steps=(driver warmup kernels cnn bench profile smoke nccl tcp2 memory zero recompute gpt llama compile resume)
wanted=("$@")
[ $# -gt 0 ] || wanted=("${all_steps[@]}")
for s in "${wanted[@]}"; do
  case " ${all_steps[*]} " in *" $s "*) ;;
    *) echo "gpu-check: unknown step '$s'; steps: ${all_steps[*]}" >&2; exit 2 ;; esac
done
wants() {
  case " ${wanted[*]} " in *" $1 "*) ;; *) return 1 ;; esac
  case "${SMOKE_ONLY:+$1}" in
    cnn) record "cnn epoch vs torch_ref.py" skipped "SMOKE_ONLY"; return 1 ;;
    gpt) record "GPT recipe vs gpt_ref.py" skipped "SMOKE_ONLY"; return 1 ;;
    llama) record "llama vs transformers" skipped "SMOKE_ONLY"; return 1 ;;
    compile) record "vs torch.compile" skipped "SMOKE_ONLY"; return 1 ;;
  esac
}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
limit=${STEP_TIMEOUT:-540}
carry=target/gpu-carry
data=${DATA:-$carry/fashion-mnist}
text=${TEXT:-$carry/input.txt}
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
# On every exit, a stop by the device tool's time limit included, the logs so far go to $OUT.
trap 'tar -czf "$out/logs.tar.gz" -C "$work" logs 2>/dev/null; rm -rf "$work"' EXIT
jobs=$work/jobs logs=$work/logs
mkdir -p "$out" "$jobs" "$logs"
: > "$work/steps.jsonl"
failed=0

# record STEP ok|FAIL|skipped DETAIL: one table row, then the report and logs rewritten, so a
# command stopped at its time limit still leaves everything done so far in $OUT.
record() {
  printf '%-34s %-8s %s\n' "$1" "$2" "$3"
  [ "$2" = FAIL ] && failed=$((failed + 1))
  "$python" - "$@" "$work/steps.jsonl" "$out/gpu-check.json" "$device" "$failed" <<'PY' \
    || echo "gpu-check: $python could not write the JSON report" >&2
import json, sys
step, status, detail, steps_path, report, device, failed = sys.argv[1:8]
with open(steps_path, "a") as f:
    f.write(json.dumps({"step": step, "status": status, "detail": detail}) + "\n")
steps = [json.loads(l) for l in open(steps_path) if l.strip()]
json.dump({"device": device, "steps": steps, "failed": int(failed)}, open(report, "w"), indent=1)
PY
  tar -czf "$out/logs.tar.gz" -C "$work" logs 2>/dev/null || true
}
tail_of() { tail -n "${2:-3}" "$1" 2>/dev/null | tr '\n' ' '; }
# compare_weights JOB_A JOB_B TOLERANCE: the two jobs' model.safetensors (f32), "bit-identical"
# or their largest difference; fails when that exceeds TOLERANCE (0: bit for bit).
compare_weights() {
  "$python" - "$1/model.safetensors" "$2/model.safetensors" "$3" <<'PY'
import array, json, struct, sys
def load(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k != "__metadata__":
            a = array.array("f")
            a.frombytes(b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            out[k] = a
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
if a.keys() != b.keys() or any(len(a[k]) != len(b[k]) for k in a):
    print("the two runs' weights differ in names or sizes"); sys.exit(1)
if all(a[k].tobytes() == b[k].tobytes() for k in a):
    print("bit-identical"); sys.exit(0)
diff = max(max((abs(x - y) for x, y in zip(a[k], b[k])), default=0.0) for k in a)
print(f"not bit-identical: max |difference| {diff:g}"); sys.exit(0 if diff <= float(sys.argv[3]) else 1)
PY
}
summary() { "$python" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(" ".join(f"{k}={s.get(k)}" for k in sys.argv[2:]))' "$@"; }

# The binary: target/gpu-carry's, unpacked with Python's lzma (the GPU machine has Python for
# PyTorch, maybe not xz), run through run-gpu.sh (the CUDA libraries of that Python's wheels).
# `bash` runs the wrapper in case the carry lost its mode; the wrapper execs the binary, so a
# signal sent to the pid reaches ddpjob.
if [ -n "${BIN:-}" ]; then read -r -a bin <<< "$BIN"
elif [ "$device" = cpu ]; then bin=(target/release/ddpjob)
elif [ -f "$carry/ddpjob.xz" ]; then
  "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$carry/ddpjob.xz" "$work/ddpjob" && chmod +x "$work/ddpjob" \
    || { echo "gpu-check: cannot unpack $carry/ddpjob.xz with $python" >&2; exit 1; }
  bin=(bash "$carry/run-gpu.sh" "$work/ddpjob")
else bin=(bash target/gpu-dist/run-gpu.sh target/gpu-dist/ddpjob); fi
[ -x "${bin[-1]}" ] || { echo "gpu-check: no binary at ${bin[-1]} (build-cuda.sh, then gpu-pack.sh)" >&2; exit 1; }
wrapper=("${bin[@]:0:${#bin[@]}-1}")   # what runs the binary: run-gpu.sh, or nothing
ddpjob() { timeout -k 10 "$limit" "${bin[@]}" "$@"; }
gpu=(--set "distributed.device=$device")

echo "# ddpjob GPU check on $(uname -n), device $device, steps: ${wanted[*]}"
if wants driver; then
  if [ "$device" = cuda ]; then
    if smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
      record "driver and GPU" ok "$smi"
    else record "driver and GPU" FAIL "$smi"; fi
  else record "driver and GPU" skipped "DEVICE=cpu dry run"
  fi
  # The libraries as the loader finds them for the binary, with the wrapper's library path.
  if libs=$("${wrapper[@]}" ldd "${bin[-1]}" 2>&1); then
    missing=$(grep 'not found' <<< "$libs" | awk '{print $1}' | paste -sd' ')
    nccl=$(awk '/libnccl/ {print $3}' <<< "$libs")
    if [ -n "$missing" ]; then record "libraries ddpjob loads" FAIL "not found: $missing"
    else record "libraries ddpjob loads" ok "NCCL: ${nccl:-not linked (a CPU build)}"; fi
  else record "libraries ddpjob loads" FAIL "ldd: $(head -c 300 <<< "$libs")"; fi
fi

# Every kernel the jobs below use, loaded once untimed: on a GPU the driver compiles candle's
# PTX for the device at first load (and caches it), which would otherwise land in the first
# timed steps. Two steps each of the smoke job's model and of the GPT recipe's, in f32 and bf16.
if wants warmup; then
  started=$SECONDS
  ok=1
  for precision in f32 bf16; do
    ddpjob bench step --config configs/smoke.toml "${gpu[@]}" --set "train.precision=$precision" \
      --steps 1 --warmup 1 >> "$logs/warmup.log" 2>&1 || ok=0
    if [ -f "$text" ]; then
      gpt_config=configs/shakespeare-char-gpu.toml
      [ "$device" = cpu ] && gpt_config=configs/shakespeare-char.toml
      ddpjob bench step --config "$gpt_config" "${gpu[@]}" --set "data.path=$text" \
        --set "train.precision=$precision" --steps 1 --warmup 1 >> "$logs/warmup.log" 2>&1 || ok=0
    fi
  done
  if [ "$ok" = 1 ]; then record "warm-up (kernels loaded)" ok "$((SECONDS - started)) s"
  else record "warm-up (kernels loaded)" FAIL "$(tail_of "$logs/warmup.log")"; fi
fi

# The unit tests that need a GPU (named `the_gpu_*`; they skip themselves without one): each
# kernel ddpjob compiles with NVRTC against its host reference.
if wants kernels; then
  if [ "$device" = cpu ]; then record "kernels vs host references" skipped "DEVICE=cpu dry run"
  elif ! compgen -G "$carry/ddpjob-tests-*.xz" > /dev/null; then
    record "kernels vs host references" FAIL "no $carry/ddpjob-tests-*.xz (bench/gpu-pack.sh packs them)"
  else
    # One executable per crate with GPU tests; the step passes when every one does.
    ok=1 passed=0 failed=0
    : > "$logs/kernels.log"
    for packed in "$carry"/ddpjob-tests-*.xz; do
      exe="$work/$(basename "$packed" .xz)"
      if "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
           "$packed" "$exe" && chmod +x "$exe" \
         && timeout -k 10 "$limit" "${wrapper[@]}" "$exe" the_gpu --test-threads 1 > "$exe.log" 2>&1; then :
      else ok=0; fi
      { echo "== $(basename "$exe")"; cat "$exe.log"; } >> "$logs/kernels.log"
      p=0 f=0
      read -r p f < <(grep -o '[0-9]* passed; [0-9]* failed' "$exe.log" | tail -1 | awk '{print $1, $3}')
      passed=$((passed + ${p:-0})) failed=$((failed + ${f:-0}))
    done
    if [ "$ok" = 1 ]; then record "kernels vs host references" ok "$passed passed; $failed failed"
    else record "kernels vs host references" FAIL "$(grep -E 'panicked|FAILED|failures:' "$logs/kernels.log" | head -3 | tr '\n' ' ')$(tail_of "$logs/kernels.log" 2)"; fi
  fi
fi

# The cnn's steps come right after the kernels' (its epoch against torch, its step, the steps'
# kernels by ncu): the figures still to be measured on a GPU, kept even when a later step runs
# past the device tool's time limit.
# A Fashion-MNIST cnn epoch against torch_ref.py on the same device (the machine's PyTorch).
ref() { for p in "$carry/ref/$1" "../shared/bench/$1"; do [ -f "$p" ] && { echo "$p"; return; }; done; echo "$carry/ref/$1"; }
if wants cnn; then
  if [ -f "$data/train-images-idx3-ubyte.gz" ]; then
    if line=$(DEVICE=$device DATA=$data BIN="${bin[*]}" PYTHON=$python TORCH_REF=$(ref torch_ref.py) \
          timeout -k 10 "$limit" bench/vs-torch.sh cnn 1 2> "$logs/cnn.err" | tee "$logs/cnn.log" | tail -1) \
       && [ -n "$line" ]; then
      record "cnn epoch vs torch_ref.py" ok "$line"
    else record "cnn epoch vs torch_ref.py" FAIL "$(tail_of "$logs/cnn.err" 2)"; fi
  else record "cnn epoch vs torch_ref.py" FAIL "no Fashion-MNIST in $data (carry its four .gz files)"; fi
fi

if wants bench; then
  # `bench step`: the cnn's (BENCH_CONFIG's) training step on the device, against the device's measured GEMM rate;
  # the host's time to queue a step beside the step's (near it: the host's calls are the limit), and
  # the phases by the device's clock (CUDA events). Then the step the `cnn` epoch runs (batch 64, no
  # accumulation, clipping or decay, as bench/vs-torch.sh sets it): its time against the epoch's time
  # per step says what the training loop adds around the step.
  steps=300
  [ -n "${QUICK:-}" ] && steps=30
  bench_step_row() {  # NAME LOG-NAME ARGS...
    local name=$1 file=$logs/$2; shift 2
    if ddpjob bench step "$@" "${gpu[@]}" --steps "$steps" --json > "$file.json" 2> "$file.err" \
       && detail=$("$python" -c "import json,sys; r=json.load(open(sys.argv[1])); print('%s: %.0f samples/s, step %.2f ms, queued by the host in %.2f ms (%s clock: forward %.2f, backward %.2f, update %.2f), %.1f%% of %.0f GFLOP/s' % (r['device'], r['samples_per_s'], r['step_ms_median'], r['queue_ms_median'], r['phase_clock'], r['forward_ms'], r['backward_ms'], r['update_ms'], 100 * (r['fraction_of_peak'] or 0), r['gemm_peak_gflops']))" "$file.json"); then
      record "$name" ok "$detail"
    else record "$name" FAIL "$(tail_of "$file.err" 2)"; fi
  }
  bench_step_row "bench step" bench-step --config "${BENCH_CONFIG:-configs/fashion-mnist.toml}"
  bench_step_row "bench step (the cnn epoch's step)" bench-step-cnn-epoch --config configs/fashion-mnist.toml \
    --set model.arch=cnn --set train.accumulation=1 --set train.lr=0.001 --set train.weight_decay=0 \
    --set train.grad_clip_norm=0

  # `bench allreduce`: NCCL between GPUs (one per worker), the tcp ring on the CPU.
  gpus=2
  [ "$device" = cuda ] && gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  if [ "$gpus" -lt 2 ]; then
    record "bench allreduce" skipped "$gpus GPU: NCCL needs a GPU per worker, two at least"
  elif ddpjob bench allreduce --device "$device" --nproc-per-node "$gpus" --sizes "${ALLREDUCE_SIZES:-1M,10M,100M}" \
         > "$logs/bench-allreduce.txt" 2>&1; then
    record "bench allreduce" ok "$(tail -1 "$logs/bench-allreduce.txt" | tr -s ' ')"
  else record "bench allreduce" FAIL "$(tail_of "$logs/bench-allreduce.txt" 2)"; fi
fi

# Where a model's step goes, kernel by kernel, for each of PROFILE_MODEL's models (default
# "gpt cnn": the GPT recipe's step, and the cnn's at batch 64 as the `cnn` step runs it; "llama"
# the llama step's): ncu's duration of every kernel of one warm-up and one timed `bench step`
# (profiled one at a time, so this takes ~40 s for the GPT), summed by kernel and grid; the top
# 20 in logs/profile-MODEL.txt, the top 3 in the report.
if wants profile; then
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for profiled_model in ${PROFILE_MODEL:-gpt cnn}; do
    case $profiled_model in
      llama)
        launches=${PROFILE_LAUNCHES:-12000}
        [ -f "$work/llama/job.toml" ] || "$python" bench/llama_ref.py prepare "$work/llama" "$text" \
          --layers "${LLAMA_LAYERS:-30}" >> "$logs/llama-prepare.log" 2>&1
        profiled=(--config "$work/llama/job.toml" --set train.precision=bf16 --set "train.batch_size=${LLAMA_BATCH:-32}")
        needs=$text ;;
      cnn)
        # `bench step` draws random batches of the data set's shape: no files needed.
        launches=${PROFILE_LAUNCHES:-3000}
        profiled=(--config configs/fashion-mnist.toml --set "data.root=$data" --set train.batch_size=64 --set train.accumulation=1)
        needs= ;;
      gpt)
        launches=${PROFILE_LAUNCHES:-4000}
        profiled=(--config configs/shakespeare-char-gpu.toml --set "data.path=$text")
        needs=$text ;;
      *)
        record "profile (ncu, $profiled_model step)" FAIL "PROFILE_MODEL names gpt, cnn or llama"
        continue ;;
    esac
    label=$profiled_model; [ "$label" = gpt ] && label=GPT
    csv_out=$logs/profile-$profiled_model.csv txt_out=$logs/profile-$profiled_model.txt
    if [ "$device" = cpu ]; then record "profile (ncu, $label step)" skipped "DEVICE=cpu dry run"
    elif [ -z "$ncu" ]; then record "profile (ncu, $label step)" skipped "no ncu on this machine"
    elif [ -n "$needs" ] && [ ! -f "$needs" ]; then record "profile (ncu, $label step)" FAIL "no $needs"
    elif timeout -k 10 "$limit" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
           --print-summary per-kernel --launch-count "$launches" \
           "${bin[@]}" bench step "${profiled[@]}" "${gpu[@]}" \
           --steps 1 --warmup 1 --no-peak > "$csv_out" 2> "$logs/profile-$profiled_model.err" \
         && detail=$("$python" - "$csv_out" "$txt_out" <<'PY'
import collections, csv, sys
rows = list(csv.reader(line for line in open(sys.argv[1]) if line.startswith('"')))
head, total = rows[0], collections.defaultdict(lambda: [0, 0.0])
col = {name: head.index(name) for name in ("Kernel Name", "Grid Size", "Invocations", "Average", "Metric Unit")}
scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}
for r in rows[1:]:
    key = (r[col["Kernel Name"]][:48], r[col["Grid Size"]])
    calls = int(r[col["Invocations"]])
    total[key][0] += calls
    total[key][1] += calls * float(r[col["Average"]].replace(",", "")) * scale[r[col["Metric Unit"]]]
top = sorted(total.items(), key=lambda kv: -kv[1][1])
ms = sum(v[1] for v in total.values())
with open(sys.argv[2], "w") as out:
    out.write(f"{ms:.1f} ms in {sum(v[0] for v in total.values())} kernels (start-up, warm-up and timed step)\n")
    for (name, grid), (calls, t) in top[:20]:
        out.write(f"{t:9.2f} ms {calls:6d} x {1e3 * t / calls:8.1f} us  {name}  grid {grid}\n")
print(f"{ms:.0f} ms of kernels; top: " + "; ".join(f"{n} {t:.1f} ms/{c}" for (n, _), (c, t) in top[:3]))
PY
         ); then record "profile (ncu, $label step)" ok "$detail (logs/profile-$profiled_model.txt)"
    else record "profile (ncu, $label step)" FAIL "$(tail_of "$logs/profile-$profiled_model.err" 2)"; fi
  done
fi

# The smoke job, f32 and bf16, with its [expect] checks and a JUnit report each.
if wants smoke; then
  for precision in f32 bf16; do
    log=$logs/smoke-$precision.log
    if ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name "smoke-$precision" "${gpu[@]}" \
         --set "train.precision=$precision" --junit "$out/smoke-$precision.xml" > "$log" 2>&1; then
      record "smoke $precision (--junit)" ok "$(summary "$jobs/smoke-$precision/summary.json" test_accuracy final_train_loss train_samples_per_s)"
    else record "smoke $precision (--junit)" FAIL "$(tail_of "$log")"; fi
  done
fi

# NCCL at world size 1, its collectives exercised (distributed.collectives = "always": the
# bucketed all-reduce, the stop vote, the broadcasts), against the same job on the same GPU
# skipping them: NCCL's mean over one rank is the identity, so the weights must be
# bit-identical.
if wants nccl; then
  if [ "$device" = cuda ]; then
    ok=1
    ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name nccl1 "${gpu[@]}" --set distributed.backend=nccl \
      --set distributed.collectives=always --nproc-per-node 1 > "$logs/nccl1.log" 2>&1 || ok=0
    ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name local1 "${gpu[@]}" \
      --nproc-per-node 1 > "$logs/local1.log" 2>&1 || ok=0
    if [ "$ok" = 1 ] && detail=$("$python" - "$jobs/nccl1" "$jobs/local1" <<'PY'
import hashlib, json, sys
a, b = sys.argv[1:3]
h = [hashlib.sha256(open(f"{d}/model.safetensors", "rb").read()).hexdigest() for d in (a, b)]
s = [json.load(open(f"{d}/summary.json")) for d in (a, b)]
same = "bit-identical" if h[0] == h[1] else "DIFFERENT"
print(f"weights {same} (sha256 {h[0][:12]} vs {h[1][:12]}); final loss {s[0]['final_train_loss']:.6f} vs {s[1]['final_train_loss']:.6f}")
sys.exit(0 if h[0] == h[1] else 1)
PY
    ); then record "NCCL world 1 vs no collectives" ok "$detail"
    else record "NCCL world 1 vs no collectives" FAIL "${detail:-$(tail_of "$logs/nccl1.log" 2) $(tail_of "$logs/local1.log" 2)}"; fi
  else
    record "NCCL world 1 vs no collectives" skipped "DEVICE=cpu dry run"
  fi
fi

# Two workers sharing the device over the tcp backend (on a GPU: gradients from the device to
# the host, across processes, and back), against one worker with their two batches in one:
# the same job up to float rounding (DDP's equivalence; 7e-9 after 40 CPU steps).
if wants tcp2; then
  ok=1
  ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name one-worker "${gpu[@]}" \
    --nproc-per-node 1 > "$logs/one-worker.log" 2>&1 || ok=0
  share=()
  [ "$device" = cuda ] && share=(--set 'distributed.devices=[0,0]')
  ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name two-workers "${gpu[@]}" "${share[@]}" \
    --nproc-per-node 2 --set distributed.backend=tcp --set train.batch_size=16 \
    > "$logs/two-workers.log" 2>&1 || ok=0
  if [ "$ok" = 1 ] && detail=$(compare_weights "$jobs/one-worker" "$jobs/two-workers" 1e-4); then
    record "2 workers on one device (tcp)" ok "vs 1 worker with both batches: $detail"
  else
    record "2 workers on one device (tcp)" FAIL "${detail:-$(tail_of "$logs/one-worker.log" 2) $(tail_of "$logs/two-workers.log" 2)}"
  fi
fi

# The memory estimate against the GPU's free memory: the GPT recipe fits (validate says so);
# a GPT of 11 B parameters (AdamW: ~176 GB a worker unsharded) is refused before launch, exit
# 2, with the settings that would make it fit, and no job directory.
if wants memory; then
  if [ "$device" = cuda ]; then
    ddpjob validate configs/shakespeare-char-gpu.toml --set "data.path=\"$text\"" \
      > "$logs/memory-validate.log" 2>&1
    fits=$(grep -E "fits GPU|does not fit" "$logs/memory-validate.log" | head -1)
    ddpjob run configs/shakespeare-char-gpu.toml --jobs-dir "$jobs" --name too-big "${gpu[@]}" \
      --set "data.path=\"$text\"" --set model.n_layer=24 --set model.n_embd=6144 \
      --set model.n_head=48 > "$logs/memory-too-big.log" 2>&1
    code=$?
    if [[ "$fits" == *"fits GPU"* ]] && [ "$code" = 2 ] && [ ! -d "$jobs/too-big" ] \
         && grep -q "but GPU 0 has" "$logs/memory-too-big.log"; then
      record "memory estimate vs free memory" ok "${fits# } | 11 B GPT refused: $(grep -o 'each worker needs about [^(]*' "$logs/memory-too-big.log" | head -1)"
    else
      record "memory estimate vs free memory" FAIL "validate: ${fits:-no verdict}; run exit $code: $(tail_of "$logs/memory-too-big.log" 2)"
    fi
  else
    record "memory estimate vs free memory" skipped "DEVICE=cpu dry run"
  fi
fi

# ZeRO-3 on the device: the GPT recipe's model for 20 steps (batch 16, evaluations and
# checkpoints every 10) with sharding "gradients" and "full", on two workers sharing the GPU
# over tcp and on one worker through NCCL with its collectives exercised: "full" gathers each
# block's parameters into their device storage and lets it go after, and must give the
# "gradients" job's weights bit for bit in both.
if wants zero; then
  if [ "$device" = cuda ]; then
    zero_job() {
      local name=$1 mode=$2; shift 2
      ddpjob run configs/shakespeare-char-gpu.toml --jobs-dir "$jobs" --name "$name" "${gpu[@]}" \
        --set "data.path=\"$text\"" --set train.max_steps=20 --set train.batch_size=16 \
        --set train.eval_every=10 --set train.eval_batches=2 --set checkpoint.every_steps=10 \
        --set "distributed.sharding=\"$mode\"" "$@" > "$logs/$name.log" 2>&1
    }
    ok=1
    for mode in gradients full; do
      zero_job "zero-tcp-$mode" "$mode" --nproc-per-node 2 --set 'distributed.devices=[0,0]' \
        --set distributed.backend=tcp || ok=0
      zero_job "zero-nccl-$mode" "$mode" --nproc-per-node 1 --set distributed.backend=nccl \
        --set distributed.collectives=always || ok=0
    done
    if [ "$ok" = 1 ] \
       && tcp=$(compare_weights "$jobs/zero-tcp-gradients" "$jobs/zero-tcp-full" 0) \
       && nccl=$(compare_weights "$jobs/zero-nccl-gradients" "$jobs/zero-nccl-full" 0); then
      record "sharding full vs gradients" ok "2 workers over tcp: $tcp; NCCL world 1: $nccl"
    else
      record "sharding full vs gradients" FAIL "${tcp:-} ${nccl:-} $(tail_of "$logs/zero-tcp-full.log" 2) $(tail_of "$logs/zero-nccl-full.log" 2)"
    fi
  else
    record "sharding full vs gradients" skipped "DEVICE=cpu dry run"
  fi
fi

# Activation checkpointing on the device: each block's forward run again in backward must give
# the weights of the job that kept its activations, bit for bit (dropout included).
if wants recompute; then
  if [ ! -f "$text" ]; then
    record "activation checkpointing" FAIL "no $text (carry the tiny Shakespeare text)"
  elif [ "$device" = cuda ]; then
    for ckpt in false true; do
      ddpjob run configs/shakespeare-char-gpu.toml --jobs-dir "$jobs" --name "recompute-$ckpt" \
        "${gpu[@]}" --set "data.path=\"$text\"" --set train.max_steps=20 --set train.batch_size=16 \
        --set train.eval_every=10 --set train.eval_batches=2 \
        --set "train.activation_checkpointing=$ckpt" > "$logs/recompute-$ckpt.log" 2>&1
    done
    if same=$(compare_weights "$jobs/recompute-false" "$jobs/recompute-true" 0); then
      record "activation checkpointing" ok "against activations kept: $same"
    else
      record "activation checkpointing" FAIL "${same:-} $(tail_of "$logs/recompute-true.log" 2)"
    fi
  else
    record "activation checkpointing" skipped "DEVICE=cpu dry run"
  fi
fi

# The GPT recipe against gpt_ref.py, each for the same number of steps.
if wants gpt; then
  if [ -f "$text" ]; then
    config=configs/shakespeare-char-gpu.toml
    [ "$device" = cpu ] && config=configs/shakespeare-char.toml
    steps=${GPT_STEPS:-}
    [ -n "${QUICK:-}" ] && steps=${steps:-200}
    steps=${steps:-500}
    [ "$steps" = all ] && steps=
    if [ -n "$steps" ]; then
      sed "s/^max_steps *=.*/max_steps = $steps/" "$config" > "$work/gpt.toml"
      config=$work/gpt.toml
    fi
    if line=$(DEVICE=$device TEXT=$text BIN="${bin[*]}" PYTHON=$python GPT_REF=$(ref gpt_ref.py) CONFIG=$config \
          timeout -k 10 "$limit" bench/gpt-vs-torch.sh 1 2> "$logs/gpt.err" | tee "$logs/gpt.log" | tail -1) \
       && [ -n "$line" ]; then
      record "GPT recipe vs gpt_ref.py" ok "${steps:-all} steps: $line"
    else record "GPT recipe vs gpt_ref.py" FAIL "$(tail_of "$logs/gpt.err" 2)"; fi
  else record "GPT recipe vs gpt_ref.py" FAIL "no text at $text (carry tiny Shakespeare)"; fi
fi

# A SmolLM2-135M-shaped Llama (random weights written by transformers' save_pretrained, a BPE
# trained on the text) fine-tuned by ddpjob and by transformers from the same directory on the
# same windows in bf16 (ddpjob's train.precision; transformers under torch.autocast, f32
# weights), then the validation split scored by `ddpjob eval` and under torch.no_grad().
# transformers runs with its default attention (sdpa: fused kernels) and with eager attention
# (unfused, as ddpjob's). Tokens/s: the median step after two.
if wants llama; then
  lwork=$work/llama layers=${LLAMA_LAYERS:-30} lsteps=${LLAMA_STEPS:-40} lbatch=${LLAMA_BATCH:-32}
  ok=1
  "$python" bench/llama_ref.py prepare "$lwork" "$text" --layers "$layers" > "$logs/llama-prepare.log" 2>&1 || ok=0
  [ "$ok" = 1 ] && { ddpjob run "$lwork/job.toml" --jobs-dir "$jobs" --name llama "${gpu[@]}" \
      --set train.precision=bf16 --set "train.batch_size=$lbatch" --set "train.max_steps=$lsteps" \
      > "$logs/llama-run.log" 2>&1 || ok=0; }
  [ "$ok" = 1 ] && { ddpjob eval llama --jobs-dir "$jobs" --json > "$logs/llama-eval.json" 2> "$logs/llama-eval.err" || ok=0; }
  for attn in sdpa eager; do
    [ "$ok" = 1 ] && { timeout -k 10 "$limit" "$python" bench/llama_ref.py train "$lwork" --steps "$lsteps" \
        --device "$device" --precision bf16 --attn "$attn" --batch "$lbatch" --threads "$(nproc)" \
        2> "$logs/llama-ref-$attn.err" | tail -1 > "$logs/llama-ref-$attn.json" || ok=0; }
  done
  if [ "$ok" = 1 ] && detail=$("$python" - "$jobs/llama" "$logs" <<'PY'
import json, statistics, sys
job, logs = sys.argv[1:3]
steps = [json.loads(l) for l in open(f"{job}/metrics.jsonl") if '"kind":"train"' in l]
ours = statistics.median(s["samples_per_s"] for s in steps[2:]) * 256
ev = json.load(open(f"{logs}/llama-eval.json"))
refs = {a: json.load(open(f"{logs}/llama-ref-{a}.json")) for a in ("sdpa", "eager")}
first = max(abs(a - b) for a, b in zip([s["loss"] for s in steps[:3]], refs["sdpa"]["losses"][:3]))
print(f"train tokens/s {ours:,.0f} vs {refs['sdpa']['train_tokens_per_s']:,.0f} sdpa "
      f"({ours / refs['sdpa']['train_tokens_per_s']:.2f}x), {refs['eager']['train_tokens_per_s']:,.0f} eager "
      f"({ours / refs['eager']['train_tokens_per_s']:.2f}x); eval tokens/s {ev['per_s']:,.0f} vs "
      f"{refs['sdpa']['eval_tokens_per_s']:,.0f} ({ev['per_s'] / refs['sdpa']['eval_tokens_per_s']:.2f}x); "
      f"eval loss {ev['loss']:.4f} vs {refs['sdpa']['eval_loss']:.4f}; first 3 losses max |diff| {first:.3f}")
PY
  ); then record "llama vs transformers" ok "$layers layers, batch $lbatch x 256, $lsteps steps: $detail"
  else record "llama vs transformers" FAIL "${detail:-$(tail_of "$logs/llama-prepare.log" 2) $(tail_of "$logs/llama-run.log" 2) $(tail_of "$logs/llama-eval.err" 2) $(tail_of "$logs/llama-ref-sdpa.err" 2)}"; fi
fi

# Against torch.compile (nanoGPT's GPU set-up: the model compiled, AdamW fused): the GPT recipe
# and GPT-2 124M's shape against gpt_ref.py --bf16 --compile, the SmolLM2-shaped llama against
# transformers under torch.compile (bench/compile-vs-torch.sh: tokens/s and the ratio, peak GPU
# memory sampled the same way for both, model FLOPs utilisation), a command and a row a case.
if wants compile; then
  for c in gpt-recipe gpt2-124m llama; do
    if [ ! -f "$text" ]; then record "vs torch.compile: $c" FAIL "no text at $text"; continue; fi
    if line=$(DEVICE=$device TEXT=$text BIN="${bin[*]}" PYTHON=$python GPT_REF=$(ref gpt_ref.py) \
          CASES=$c LLAMA_LAYERS=${LLAMA_LAYERS:-30} STEPS=${COMPILE_STEPS:-300} \
          timeout -k 10 "$limit" bench/compile-vs-torch.sh 2> "$logs/compile-$c.err" \
          | tee "$logs/compile-$c.log" | tail -2 | head -1) && [ -n "$line" ] \
       && [[ "$line" != *failed* ]]; then
      record "vs torch.compile: $c" ok "${line#*: }"
    else record "vs torch.compile: $c" FAIL "${line:-$(tail_of "$logs/compile-$c.err" 2)}"; fi
  done
fi

# SIGTERM in the middle of a run, then `resume`, against the same job uninterrupted: the final
# weights must be bit-identical (the same device, the same kernels, the same order).
if wants resume; then
  # 300 epochs may overfit the smoke job's data: its [expect] thresholds are not what is checked.
  long=(--set train.epochs=300 --set checkpoint.every_epochs=0 --set expect.max_wall_s=36000
        --set expect.min_test_accuracy=0 --set expect.max_test_loss=1e9
        --set expect.max_final_loss=1e9 --set expect.min_train_samples_per_s=1e-9)
  whole_ok=1
  ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name whole "${gpu[@]}" "${long[@]}" \
    > "$logs/whole.log" 2>&1 || whole_ok=0
  # In the background under `timeout --foreground`, which passes a SIGTERM on to the binary
  # alone (run-gpu.sh execs it), once (without --foreground it signals its process group too,
  # and a second SIGTERM tells ddpjob to stop at once), and returns its exit status; -k gives
  # the graceful stop time to checkpoint.
  timeout --foreground -k 120 "$limit" "${bin[@]}" run configs/smoke.toml --jobs-dir "$jobs" \
    --name cut "${gpu[@]}" "${long[@]}" > "$logs/cut.log" 2>&1 &
  pid=$!
  reached=0
  for _ in $(seq 2400); do   # up to 120 s for the start (CUDA's) and 200 steps
    grep -qs '"step":200,' "$jobs/cut/metrics.jsonl" && { reached=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"; status=$?
  if [ "$whole_ok" = 0 ]; then
    record "SIGTERM, resume vs uninterrupted" FAIL "the uninterrupted run failed: $(tail_of "$logs/whole.log" 2)"
  elif [ "$reached" = 0 ]; then
    record "SIGTERM, resume vs uninterrupted" FAIL "the run to cut never reached step 200 (exit $status): $(tail_of "$logs/cut.log" 2)"
  elif [ "$status" != 143 ]; then
    record "SIGTERM, resume vs uninterrupted" FAIL "SIGTERM gave exit $status, not 143: $(tail_of "$logs/cut.log" 2)"
  elif ! ddpjob resume cut --jobs-dir "$jobs" > "$logs/resume.log" 2>&1; then
    record "SIGTERM, resume vs uninterrupted" FAIL "resume failed: $(tail_of "$logs/resume.log" 2)"
  elif detail=$(compare_weights "$jobs/whole" "$jobs/cut" 0); then
    record "SIGTERM, resume vs uninterrupted" ok "exit 143, resumed; $detail"
  else record "SIGTERM, resume vs uninterrupted" FAIL "exit 143, resumed; $detail"; fi
fi

echo "report: $out/gpu-check.json, logs: $out/logs.tar.gz; $failed step(s) failed"
[ "$failed" = 0 ]
