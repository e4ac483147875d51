#!/usr/bin/env bash
# Tokenising a conversational parquet set through the chat template: ddpjob (the records made
# on every core; timed as the `ddpjob run` that makes a job of them, one optimizer step of a
# tiny model and one evaluation batch after) against Hugging Face
# `datasets.map(apply_chat_template(..., return_assistant_tokens_mask=True), batched=True,
# num_proc=<cores>)` on the same shards, with the same tokenizer (a 32,768-token byte-level BPE)
# and template. Prints rows/s and peak memory of each and the ratio.
#
# KIND=text: documents (a `text` column) instead, which ddpjob reads as one corpus of token
# windows, timed the same way, against `datasets.map(tokenizer(batch["text"]), batched=True,
# num_proc=<cores>)`, run_clm.py's tokenising.
#
# With TRL_PYTHON (a Python with torch and trl), conversations are also timed through TRL's own
# preprocessing, `SFTTrainer(..., SFTConfig(assistant_only_loss=True, dataset_num_proc=<cores>))`.
#
#   bench/tokenize-vs-datasets.sh            MB=50 (the set's size), KIND=chat|text, PYTHON
#                                            with datasets, transformers, pyarrow, tokenizers,
#                                            TRL_PYTHON, BIN (default target/release/ddpjob)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
mb=${MB:-50}
kind=${KIND:-chat}
work=${WORK:-/tmp/tokenize-bench-$kind-$mb}
bin=${BIN:-$here/target/release/ddpjob}
text=${TEXT:-$here/../shared/data/tinyshakespeare/input.txt}
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
[ -f "$work/job.toml" ] || "$python" "$here/bench/tokenize_ref.py" prepare "$work" "$text" --mb "$mb" --kind "$kind"
lscpu | sed -n 's/^Model name: *//p'
cores=$(nproc)
started=$(date +%s.%N)
rm -rf "$work/jobs"
DDPJOB_PLAIN=1 /usr/bin/time -f "%M" -o "$work/ddpjob-rss" "$bin" run "$work/job.toml" \
  --jobs-dir "$work/jobs" > "$work/ddpjob.log" 2>&1
ended=$(date +%s.%N)
job=$work/jobs/tokenize-bench
if [ "$kind" = text ]; then
  # The corpus's tokens as the job keeps them (one end-of-sequence token a row more than
  # datasets' ids).
  sizes=$(stat -c %s "$job/rows-train.tokens" "$job/rows-val.tokens")
  echo "{\"tokens\": $(( ($(echo "$sizes" | paste -sd+)) / 4 ))}" > "$work/ddpjob.json"
else
  # The examples' tokens, from the stored files' headers (the fourth u32 after the magic).
  "$python" -c 'import json,struct,sys; print(json.dumps({"tokens": sum(struct.unpack_from("<I", open(p, "rb").read(24), 20)[0] for p in sys.argv[1:])}))' \
    "$job/jsonl-train.bin" "$job/jsonl-val.bin" > "$work/ddpjob.json"
fi
"$python" "$here/bench/tokenize_ref.py" datasets "$work" --procs "$cores" 2>/dev/null | tail -1 > "$work/datasets.json"
# TRL's own preprocessing, for conversations, where a Python with torch and trl is given.
rm -f "$work/trl.json"
if [ "$kind" = chat ] && [ -n "${TRL_PYTHON:-}" ]; then
  "$TRL_PYTHON" "$here/bench/tokenize_ref.py" trl "$work" --procs "$cores" 2>/dev/null | tail -1 > "$work/trl.json"
fi
"$python" - "$work" "$started" "$ended" <<'PY'
import json, sys
from pathlib import Path
work, t0, t1 = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
ours = json.loads((work / "ddpjob.json").read_text().strip().splitlines()[-1])
secs = t1 - t0
rss = int((work / "ddpjob-rss").read_text().split()[-1]) * 1024
refs = [("datasets.map", json.loads((work / "datasets.json").read_text()))]
if (work / "trl.json").exists():
    refs.append(("TRL SFTTrainer", json.loads((work / "trl.json").read_text())))
size = sum(f.stat().st_size for f in (work / "data").iterdir())
print(f"{size / 1e6:.0f} MB of parquet ({(work / 'kind').read_text()})")
print(f"{'':16}{'ddpjob':>12}" + "".join(f"{name:>16}{'ratio':>7}" for name, _ in refs))
# Every row of the shards was read and tokenised (the validation fraction too).
rows = refs[0][1]["rows"]
rate = rows / secs
line = lambda label, ours, theirs: print(f"{label:16}{ours:>12}" + "".join(
    f"{t:>16}{'':>7}" for t in theirs))
line("rows", rows, [r["rows"] for _, r in refs])
line("tokens", ours["tokens"], [r["tokens"] for _, r in refs])
line("seconds", f"{secs:.2f}", [f"{r['seconds']:.2f}" for _, r in refs])
print(f"{'rows/s':16}{rate:12.0f}" + "".join(
    f"{r['rows_per_s']:16.0f}{rate / r['rows_per_s']:7.2f}" for _, r in refs))
line("peak RSS MB", f"{rss / 1e6:.0f}", [f"{r['peak_rss_bytes'] / 1e6:.0f}" for _, r in refs])
PY
