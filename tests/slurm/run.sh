#!/usr/bin/env bash
# End-to-end tests against a real Slurm: a two-node cluster on this machine (nodes n1 and n2,
# started by tests/slurm/local-cluster.sh, which installs Debian's slurm-wlm if missing; needs
# root). `.ci/run` calls this after `cargo test`, which stays free of Slurm.
#
#   sudo tests/slurm/run.sh            uses the binary `cargo test` built (DDPJOB_BIN to change)
set -euo pipefail
cd "$(dirname "$0")/../.."
here=$(pwd)
[ "$(id -u)" = 0 ] || { echo "tests/slurm/run.sh needs root (it starts slurmctld and slurmd)" >&2; exit 2; }
command -v python3 >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-minimal >/dev/null; }
bin=${DDPJOB_BIN:-target/debug/ddpjob}
[ -x "$bin" ] || cargo build --locked
work=$(mktemp -d /tmp/ddpjob-slurm-test.XXXX)
trap 'scancel --user=root >/dev/null 2>&1 || true; bash "$here/tests/slurm/local-cluster.sh" stop >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
bash tests/slurm/local-cluster.sh start >/dev/null
# The nodes run the binary from a path both can read (one machine: the same file system).
cp "$bin" "$work/ddpjob"
cat > "$work/tiny.toml" <<'TOML'
seed = 3
[model]
arch = "mlp"
hidden = [32]
[data]
dataset = "synthetic"
[data.synthetic]
train_samples = 512
test_samples = 256
shape = [1, 8, 8]
classes = 4
noise = 0.8
[train]
epochs = 2
batch_size = 32
lr = 0.01
log_every = 4
TOML
cd "$work"
failures=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; failures=$((failures + 1)); }

# compare A B TOLERANCE: the largest difference between two model.safetensors, within TOLERANCE.
compare() {
  python3 - "$@" <<'PY'
import array, json, struct, sys
def load(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a = array.array("f")
        a.frombytes(b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
        out[k] = a
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a.keys() == b.keys(), (a.keys(), b.keys())
diff = max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
print(f"max |{sys.argv[1]} - {sys.argv[2]}| = {diff:g}")
sys.exit(0 if diff <= float(sys.argv[3]) else 1)
PY
}

# 1. Two nodes under srun find their places from Slurm alone and train as one node with two
#    workers does. Not bit for bit here: a task under srun sees both cores of this machine (no
#    cgroups), so each worker runs 2 threads where the single-node job's 2 workers run 1 each,
#    and the row shards add in another order; the two-launcher test of `cargo test` (same
#    threads) is bit-identical.
if timeout 300 srun -N2 --ntasks-per-node=1 ./ddpjob run tiny.toml --nproc-per-node 1 > srun.out 2>&1 \
   && grep -q "note: --nnodes 2 from SLURM_STEP_NUM_NODES" srun.out \
   && grep -q "note: --master-addr n1 from the first node of SLURM_STEP_NODELIST" srun.out \
   && timeout 120 ./ddpjob run tiny.toml --nproc-per-node 2 --name single > single.out 2>&1 \
   && compare jobs/tiny/model.safetensors jobs/single/model.safetensors 1e-6; then
  pass "srun -N2: two nodes placed by Slurm match one node with two workers"
else fail "srun -N2 two-node job"; tail -20 srun.out single.out 2>/dev/null; fi

# 2. Several tasks per node: each would launch a whole node's workers. Refused, exit 2.
set +e
timeout 60 srun -N1 -n2 -O ./ddpjob run tiny.toml --name many > many.out 2>&1
status=$?
set -e
if [ "$status" = 2 ] && grep -q "srun started 2 tasks on 1 node(s)" many.out && [ ! -e jobs/many ]; then
  pass "srun -n2 on one node: refused (exit 2), nothing created"
else fail "several tasks per node (exit $status)"; cat many.out; fi

# 3. A two-node batch script that runs ddpjob without srun: it would train on one node only.
printf '#!/bin/bash\n./ddpjob run tiny.toml --name nosrun\n' > nosrun.sh
set +e
timeout 120 sbatch --wait -N2 --ntasks-per-node=1 -o nosrun.out nosrun.sh > /dev/null 2>&1
set -e
if grep -q "was not started by srun" nosrun.out && [ ! -e jobs/nosrun ]; then
  pass "two-node batch script without srun: refused, nothing created"
else fail "batch script without srun"; cat nosrun.out; fi

# 4. Slurm's warning before a time limit (SIGUSR1 to every process of the step, as
#    `--signal=USR1@N` sends it): every node checkpoints and stops; `ddpjob resume` finishes.
timeout 300 srun -N2 --ntasks-per-node=1 -J usr1 ./ddpjob run tiny.toml --nproc-per-node 1 \
  --name usr1 --set train.epochs=3000 > usr1.out 2>&1 &
srun_pid=$!
for _ in $(seq 100); do grep -q "step 40/" usr1.out 2>/dev/null && break; sleep 0.2; done
scancel --signal=USR1 --name usr1 >/dev/null 2>&1 || true
set +e
wait "$srun_pid"
status=$?
set -e
if [ "$status" = 138 ] && grep -q "interrupted by SIGUSR1" usr1.out \
   && grep -q '"status": *"interrupted"' jobs/usr1/state.json \
   && timeout 300 ./ddpjob resume usr1 --jobs-dir jobs > resume.out 2>&1 \
   && grep -q '"status": *"finished"' jobs/usr1/state.json; then
  pass "scancel --signal=USR1: both nodes checkpoint and stop (exit 138), resume finishes"
else fail "SIGUSR1 (srun exit $status)"; tail -5 usr1.out resume.out 2>/dev/null; fi

# 5. `scontrol requeue` in the middle of a batch job, on one node and on two: the job stops
#    after a checkpoint, Slurm starts the same script again with SLURM_RESTART_COUNT=1, and
#    `run` (on every node) continues the job (--resume auto) to weights bit-identical to an
#    uninterrupted run.
# interrupt_and_requeue NAME NODES HOW...: submits a --requeue batch job training NAME on NODES
# nodes (one worker each when two), runs HOW (with $jid set) once the job is 40 steps in, and
# waits until the job has finished (in its second allocation); its output is NAME.out.
interrupt_and_requeue() {
  local name=$1 nodes=$2; shift 2
  local per_node=""
  [ "$nodes" = 1 ] || per_node="--nproc-per-node 1"
  printf '#!/bin/bash\nsrun ./ddpjob run tiny.toml --name %s %s --set train.epochs=800\n' "$name" "$per_node" > "$name.sh"
  jid=$(sbatch --parsable -N"$nodes" --ntasks-per-node=1 --requeue --open-mode=append -o "$name.out" "$name.sh")
  for _ in $(seq 150); do grep -qs '"step":40,' "jobs/$name/metrics.jsonl" && break; sleep 0.2; done
  "$@" || echo "$* failed"
  # A requeued job waits about two minutes before it may start again; not here.
  for _ in $(seq 200); do
    scontrol update JobId="$jid" StartTime=now >/dev/null 2>&1 || true
    grep -qs '"status": *"finished"' "jobs/$name/state.json" && break
    sleep 1
  done
}
requeue_it() { scontrol requeue "$jid"; }
warn_it() { scancel --signal=USR1 "$jid"; }

interrupt_and_requeue requeued 1 requeue_it
if grep -qs '"status": *"finished"' jobs/requeued/state.json \
   && grep -q "interrupted by SIGTERM" requeued.out \
   && grep -q "note: --resume auto: Slurm requeued this job (SLURM_RESTART_COUNT=1)" requeued.out \
   && timeout 300 ./ddpjob run tiny.toml --name straight --set train.epochs=800 > straight.out 2>&1 \
   && compare jobs/requeued/model.safetensors jobs/straight/model.safetensors 0; then
  pass "scontrol requeue: the requeued allocation resumes, weights bit-identical"
else fail "scontrol requeue"; tail -8 requeued.out 2>/dev/null; fi

# The same job on two nodes, uninterrupted: what the two-node scenarios below must reach.
timeout 300 srun -N2 --ntasks-per-node=1 ./ddpjob run tiny.toml --name straight2 \
  --nproc-per-node 1 --set train.epochs=800 > straight2.out 2>&1 || { echo "two-node reference failed"; tail -5 straight2.out; }

interrupt_and_requeue requeued2 2 requeue_it
if grep -qs '"status": *"finished"' jobs/requeued2/state.json \
   && [ "$(grep -c "interrupted by SIGTERM" requeued2.out)" = 2 ] \
   && [ "$(grep -c "note: --resume auto: Slurm requeued this job" requeued2.out)" = 2 ] \
   && grep -q "resuming job \`requeued2\` from" requeued2.out \
   && compare jobs/requeued2/model.safetensors jobs/straight2/model.safetensors 0; then
  pass "scontrol requeue of a two-node job: both nodes resume, weights bit-identical"
else fail "scontrol requeue (two nodes)"; tail -12 requeued2.out 2>/dev/null; fi

# 6. The time-limit warning (SIGUSR1 to the steps) in a job submitted with --requeue: ddpjob
#    checkpoints, stops, requeues the job itself (scontrol requeue, as Lightning does), and the
#    next allocation continues it to the same weights.
interrupt_and_requeue warned 1 warn_it
if grep -qs '"status": *"finished"' jobs/warned/state.json \
   && grep -q "interrupted by SIGUSR1" warned.out \
   && grep -q "Slurm job $jid requeued" warned.out \
   && grep -q "SLURM_RESTART_COUNT=1" warned.out \
   && compare jobs/warned/model.safetensors jobs/straight/model.safetensors 0; then
  pass "SIGUSR1 in a --requeue job: checkpoint, requeued by ddpjob, resumed, bit-identical"
else fail "SIGUSR1 requeue"; tail -8 warned.out 2>/dev/null; fi

# The same on two nodes: node 0 requeues the job, and both nodes of the next allocation
# continue it.
interrupt_and_requeue warned2 2 warn_it
if grep -qs '"status": *"finished"' jobs/warned2/state.json \
   && [ "$(grep -c "interrupted by SIGUSR1" warned2.out)" = 2 ] \
   && grep -q "Slurm job $jid requeued" warned2.out \
   && [ "$(grep -c "note: --resume auto: Slurm requeued this job" warned2.out)" = 2 ] \
   && compare jobs/warned2/model.safetensors jobs/straight2/model.safetensors 0; then
  pass "SIGUSR1 in a two-node --requeue job: requeued by node 0, both nodes resume, bit-identical"
else fail "SIGUSR1 requeue (two nodes)"; tail -12 warned2.out 2>/dev/null; fi

# kill_node1_launcher NAME FLAGS...: a two-node srun job NAME; once it is 40 steps in, node 1's
# launcher is killed (SIGKILL; its workers die with it). Sets $took: the seconds srun took
# after the kill; the output is NAME.out.
kill_node1_launcher() {
  local name=$1; shift
  timeout 300 srun -N2 --ntasks-per-node=1 -J "$name" ./ddpjob run tiny.toml --nproc-per-node 1 \
    --name "$name" --set train.epochs=3000 "$@" > "$name.out" 2>&1 &
  local srun_pid=$!
  for _ in $(seq 100); do grep -qs '"step":40,' "jobs/$name/metrics.jsonl" && break; sleep 0.2; done
  for p in $(pgrep -f "name $name"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'SLURM_NODEID=1' \
      && tr '\0' '\n' < "/proc/$p/environ" | grep -qx 'SLURM_PROCID=1' \
      && ! tr '\0' '\n' < "/proc/$p/environ" | grep -q '^DDPJOB_JOB_DIR=' && kill -9 "$p"
  done
  local started
  started=$(date +%s)
  set +e
  wait "$srun_pid"
  set -e
  took=$(( $(date +%s) - started ))
}

# 7. Node 1's launcher killed: node 0 fails at once, naming the rank and the node that went away.
kill_node1_launcher killed
if [ "$took" -le 30 ] && grep -q "rank 1 (node 1) closed its connection" killed.out \
   && grep -q '"status": *"failed"' jobs/killed/state.json; then
  pass "node 1's launcher killed: node 0 fails within ${took} s naming rank 1 (node 1)"
else fail "launcher killed on node 1 (${took} s)"; grep -E "error" killed.out | head -5; fi

# 8. A worker killed on node 2 (rank 1) with distributed.max_restarts = 1: both nodes stop
#    their workers and start again from the same checkpoint, to the uninterrupted weights.
DDPJOB_FAULT=rank=1,step=60,kind=kill timeout 300 srun -N2 --ntasks-per-node=1 ./ddpjob run \
  tiny.toml --name restarted --nproc-per-node 1 --set train.epochs=800 \
  --set distributed.max_restarts=1 > restarted.out 2>&1 || echo "srun exit $?" >> restarted.out
if grep -qs '"status": *"finished"' jobs/restarted/state.json \
   && [ "$(grep -c "restart 1/1 of job \`restarted\` from checkpoint .* after: node 1: rank 1 (pid [0-9]*) was killed by signal 9" restarted.out)" = 2 ] \
   && grep -qs '"restarts": *1' jobs/restarted/state.json \
   && compare jobs/restarted/model.safetensors jobs/straight2/model.safetensors 0; then
  pass "worker killed on node 2, max_restarts = 1: both nodes restart, weights bit-identical"
else fail "restart across nodes"; tail -8 restarted.out 2>/dev/null; fi

# 9. Node 1's launcher killed while restarts are allowed: node 0 cannot restart without it and
#    fails within distributed.timeout_s, naming the node.
kill_node1_launcher killed2 --set distributed.max_restarts=1 --set distributed.timeout_s=10
if [ "$took" -le 25 ] && grep -q "node 1 did not stop its workers within 10 s" killed2.out \
   && grep -q '"status": *"failed"' jobs/killed2/state.json; then
  pass "node 1's launcher killed with restarts allowed: node 0 fails within ${took} s naming node 1"
else fail "launcher killed on node 1 with max_restarts (${took} s)"; grep -E "error" killed2.out | head -5; fi

echo "slurm tests: $failures failure(s)"
[ "$failures" = 0 ]
