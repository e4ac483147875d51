#!/usr/bin/env bash
# One command that checks ddpjob on a GPU machine (no network, no Rust there): the CUDA binary
# from ../shared/gpu/build-cuda.sh and data carried in the tree. Prints a table and writes a
# JSON report (gpu-check.json) to $OUT (the device tool brings $OUT back), else a temp folder.
#
#   bench/gpu-check.sh                      on the GPU machine, from the repository root, with
#                                           target/gpu-carry/ from bench/gpu-pack.sh carried
#                                           (device tool: carry ["target/gpu-carry"])
#   DEVICE=cpu bench/gpu-check.sh           the same steps on this machine's CPU (a dry run of
#                                           the script itself; GPU-only steps are skipped)
#
# env: BIN (default: target/gpu-carry's binary, else "target/gpu-dist/run-gpu.sh
#      target/gpu-dist/ddpjob"), DATA (the four Fashion-MNIST .gz files; default
#      target/gpu-carry/fashion-mnist), TEXT (default target/gpu-carry/input.txt), PYTHON (with
#      torch), QUICK=1 (a 200-step GPT run instead of the recipe's), SMOKE_ONLY=1 (skip the
#      comparisons with PyTorch, which need its data and torch: what CI's GPU job runs).
# Steps: the driver and GPU; the smoke job in f32 and bf16 with --junit; NCCL at world size 1
# against the same job on the CPU; a Fashion-MNIST cnn epoch against torch_ref.py; the GPT GPU
# recipe against gpt_ref.py; SIGTERM during a run, then resume, against an uninterrupted run.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
carry=target/gpu-carry
default_bin="target/gpu-dist/run-gpu.sh target/gpu-dist/ddpjob"
if [ -z "${BIN:-}" ] && [ -f "$carry/ddpjob.xz" ]; then
  # Unpacked with Python's lzma: the GPU machine has Python (for PyTorch), maybe not xz.
  unpacked=$(mktemp -d)/ddpjob
  "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$carry/ddpjob.xz" "$unpacked" && chmod +x "$unpacked"
  default_bin="$carry/run-gpu.sh $unpacked"
fi
read -r -a bin <<< "${BIN:-$default_bin}"
[ "$device" = cpu ] && [ -z "${BIN:-}" ] && bin=(target/release/ddpjob)
data=${DATA:-$carry/fashion-mnist}
text=${TEXT:-$carry/input.txt}
ref() { for p in "$carry/ref/$1" "../shared/bench/$1"; do [ -f "$p" ] && { echo "$p"; return; }; done; echo "$carry/ref/$1"; }
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
jobs=$(mktemp -d)
trap 'rm -rf "$jobs"' EXIT
report=$out/gpu-check.json
: > "$out/steps.jsonl"
ddpjob() { "${bin[@]}" "$@"; }

# record NAME ok|FAIL|skipped DETAIL
record() {
  printf '%-34s %-8s %s\n' "$1" "$2" "$3"
  "$python" -c 'import json,sys; print(json.dumps({"step":sys.argv[1],"status":sys.argv[2],"detail":sys.argv[3]}))' \
    "$1" "$2" "$3" >> "$out/steps.jsonl" 2>/dev/null || true
}
summary() { "$python" -c 'import json,sys; s=json.load(open(sys.argv[1])); print(" ".join(f"{k}={s.get(k)}" for k in sys.argv[2:]))' "$@"; }
gpu=(--set "distributed.device=$device")

echo "# ddpjob GPU check on $(hostname), device $device"
if [ "$device" = cuda ]; then
  if smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
    record "driver and GPU" ok "$smi"
  else record "driver and GPU" FAIL "$smi"; fi
  # run-gpu.sh puts the CUDA libraries of the machine's Python (its nvidia-* wheels) on the path.
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
  nccl=$(find "$site/nvidia" -name 'libnccl.so*' 2>/dev/null | head -1)
  record "NCCL library ddpjob loads" "$([ -n "$nccl" ] && echo ok || echo FAIL)" "${nccl:-no libnccl.so under $site/nvidia}"
else
  record "driver and GPU" skipped "DEVICE=cpu dry run"
fi

# The smoke job, f32 and bf16, with its [expect] checks and a JUnit report each.
for precision in f32 bf16; do
  if ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name "smoke-$precision" "${gpu[@]}" \
       --set "train.precision=$precision" --junit "$out/smoke-$precision.xml" > "$out/smoke-$precision.log" 2>&1; then
    record "smoke $precision (--junit)" ok "$(summary "$jobs/smoke-$precision/summary.json" test_accuracy final_train_loss train_samples_per_s)"
  else record "smoke $precision (--junit)" FAIL "$(tail -3 "$out/smoke-$precision.log" | tr '\n' ' ')"; fi
done

# NCCL at world size 1 against the same job on the CPU: the same data, order and steps, so only
# the arithmetic differs (GPU kernels sum in other orders): final losses within 1e-3.
if [ "$device" = cuda ]; then
  ok=1
  ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name nccl1 "${gpu[@]}" --set distributed.backend=nccl --nproc-per-node 1 > "$out/nccl1.log" 2>&1 || ok=0
  ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name cpu1 --set distributed.device=cpu --nproc-per-node 1 > "$out/cpu1.log" 2>&1 || ok=0
  if [ "$ok" = 1 ] && detail=$("$python" - "$jobs/nccl1/summary.json" "$jobs/cpu1/summary.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
d = abs(a["final_train_loss"] - b["final_train_loss"])
print(f"final loss nccl {a['final_train_loss']:.5f} cpu {b['final_train_loss']:.5f} (|diff| {d:.2e}, tolerance 1e-3); accuracy {a['test_accuracy']:.4f} vs {b['test_accuracy']:.4f}")
sys.exit(0 if d <= 1e-3 else 1)
PY
  ); then record "NCCL world 1 vs CPU" ok "$detail"
  else record "NCCL world 1 vs CPU" FAIL "${detail:-$(tail -2 "$out/nccl1.log" "$out/cpu1.log" | tr '\n' ' ')}"; fi
else
  record "NCCL world 1 vs CPU" skipped "DEVICE=cpu dry run"
fi

# A Fashion-MNIST cnn epoch against torch_ref.py on the same device (the machine's PyTorch).
if [ -n "${SMOKE_ONLY:-}" ]; then
  record "cnn epoch vs torch_ref.py" skipped "SMOKE_ONLY"
elif [ -f "$data/train-images-idx3-ubyte.gz" ]; then
  rounds=1
  if line=$(DEVICE=$device DATA=$data BIN="${bin[*]}" PYTHON=$python TORCH_REF=$(ref torch_ref.py) \
        bench/vs-torch.sh cnn "$rounds" 2>"$out/cnn.err" | tail -1) && [ -n "$line" ]; then
    record "cnn epoch vs torch_ref.py" ok "$line"
  else record "cnn epoch vs torch_ref.py" FAIL "$(tail -2 "$out/cnn.err" | tr '\n' ' ')"; fi
else record "cnn epoch vs torch_ref.py" FAIL "no Fashion-MNIST in $data (carry its four .gz files)"; fi

# The GPT recipe against gpt_ref.py.
if [ -n "${SMOKE_ONLY:-}" ]; then
  record "GPT recipe vs gpt_ref.py" skipped "SMOKE_ONLY"
elif [ -f "$text" ]; then
  config=configs/shakespeare-char-gpu.toml
  [ "$device" = cpu ] && config=configs/shakespeare-char.toml
  if [ -n "${QUICK:-}" ]; then
    sed 's/^max_steps *=.*/max_steps = 200/' "$config" > "$jobs/gpt-quick.toml"
    config=$jobs/gpt-quick.toml
  fi
  if line=$(DEVICE=$device TEXT=$text BIN="${bin[*]}" PYTHON=$python GPT_REF=$(ref gpt_ref.py) CONFIG=$config \
        bench/gpt-vs-torch.sh 1 2>"$out/gpt.err" | tail -1) && [ -n "$line" ]; then
    record "GPT recipe vs gpt_ref.py" ok "$line"
  else record "GPT recipe vs gpt_ref.py" FAIL "$(tail -2 "$out/gpt.err" | tr '\n' ' ')"; fi
else record "GPT recipe vs gpt_ref.py" FAIL "no text at $text (carry tiny Shakespeare)"; fi

# `bench step`: the cnn's training step on the device, against the device's measured GEMM rate.
steps=300
[ -n "${QUICK:-}" ] && steps=30
if ddpjob bench step --config configs/fashion-mnist.toml "${gpu[@]}" --steps "$steps" --json \
     > "$out/bench-step.json" 2> "$out/bench-step.err" \
   && detail=$("$python" -c "import json,sys; r=json.load(open(sys.argv[1])); print('%s: %.0f samples/s, step %.2f ms, %.1f%% of %.0f GFLOP/s' % (r['device'], r['samples_per_s'], r['step_ms_median'], 100 * (r['fraction_of_peak'] or 0), r['gemm_peak_gflops']))" "$out/bench-step.json"); then
  record "bench step (cnn)" ok "$detail"
else record "bench step (cnn)" FAIL "$(tail -2 "$out/bench-step.err" | tr '\n' ' ')"; fi

# `bench allreduce`: NCCL between GPUs (one per worker), the tcp ring on the CPU.
gpus=2
[ "$device" = cuda ] && gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
  record "bench allreduce" skipped "$gpus GPU: NCCL needs a GPU per worker, two at least"
elif ddpjob bench allreduce --device "$device" --nproc-per-node "$gpus" --sizes 1M,10M,100M \
       > "$out/bench-allreduce.txt" 2>&1; then
  record "bench allreduce" ok "$(tail -1 "$out/bench-allreduce.txt" | tr -s ' ')"
else record "bench allreduce" FAIL "$(tail -2 "$out/bench-allreduce.txt" | tr '\n' ' ')"; fi

# SIGTERM in the middle of a run, then `resume`, against the same job uninterrupted.
long=(--set train.epochs=300 --set checkpoint.every_epochs=0)
ddpjob run configs/smoke.toml --jobs-dir "$jobs" --name whole "${gpu[@]}" "${long[@]}" > "$out/whole.log" 2>&1
# The binary itself in the background (run-gpu.sh execs it), so the signal reaches the launcher.
"${bin[@]}" run configs/smoke.toml --jobs-dir "$jobs" --name cut "${gpu[@]}" "${long[@]}" > "$out/cut.log" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -qs "\"step\":200," "$jobs/cut/metrics.jsonl" && break; sleep 0.05; done
kill -TERM "$pid" 2>/dev/null
wait "$pid"; status=$?
if [ "$status" = 143 ] && ddpjob resume cut --jobs-dir "$jobs" > "$out/resume.log" 2>&1 \
   && detail=$("$python" - "$jobs/whole/model.safetensors" "$jobs/cut/model.safetensors" <<'PY'
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
diff = max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
print("bit-identical" if diff == 0 else f"max |difference| {diff:g} (not bit-identical)")
PY
   ); then record "SIGTERM, resume vs uninterrupted" ok "exit 143, resumed; $detail"
else record "SIGTERM, resume vs uninterrupted" FAIL "exit $status; $(tail -2 "$out/cut.log" "$out/resume.log" 2>/dev/null | tr '\n' ' ')"; fi

"$python" - "$out/steps.jsonl" "$report" "$device" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"device": sys.argv[3], "steps": steps,
           "failed": sum(s["status"] == "FAIL" for s in steps)}, open(sys.argv[2], "w"), indent=1)
PY
failed=$(grep -c '"status": "FAIL"' "$out/steps.jsonl" || true)
echo "report: $report; $failed step(s) failed"
[ "$failed" = 0 ]
