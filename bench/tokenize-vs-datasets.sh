#!/usr/bin/env bash
# Tokenising a conversational parquet set through the chat template: ddpjob (the records made
# on every core, as `run` makes a job's examples; timed as `ddpjob preview --json --examples 0`,
# which reads and tokenises the whole set and prints its counts) against Hugging Face
# `datasets.map(apply_chat_template(..., return_assistant_tokens_mask=True), batched=True,
# num_proc=<cores>)` on the same shards, with the same tokenizer (a 32,768-token byte-level BPE)
# and template. Prints rows/s and peak memory of each and the ratio.
#
# KIND=text: documents (a `text` column) instead, which ddpjob reads as one corpus of token
# windows; timed as the `ddpjob run` that tokenises them into a new job (one optimizer step of
# a tiny model after), against `datasets.map(tokenizer(batch["text"]), batched=True,
# num_proc=<cores>)`, run_clm.py's tokenising.
#
#   bench/tokenize-vs-datasets.sh            MB=50 (the set's size), KIND=chat|text, PYTHON
#                                            with datasets, transformers, pyarrow, tokenizers
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
if [ "$kind" = text ]; then
  rm -rf "$work/jobs"
  DDPJOB_PLAIN=1 /usr/bin/time -f "%M" -o "$work/ddpjob-rss" "$bin" run "$work/job.toml" \
    --jobs-dir "$work/jobs" > "$work/ddpjob.log" 2>&1
  ended=$(date +%s.%N)
  # The corpus's tokens as the job keeps them (one end-of-sequence token a row more than
  # datasets' ids).
  sizes=$(stat -c %s "$work/jobs/tokenize-bench/rows-train.tokens" "$work/jobs/tokenize-bench/rows-val.tokens")
  echo "{\"tokens\": $(( ($(echo "$sizes" | paste -sd+)) / 4 ))}" > "$work/ddpjob.json"
else
  /usr/bin/time -f "%M" -o "$work/ddpjob-rss" "$bin" preview "$work/job.toml" --json --examples 0 \
    > "$work/ddpjob.json"
  ended=$(date +%s.%N)
fi
"$python" "$here/bench/tokenize_ref.py" datasets "$work" --procs "$cores" 2>/dev/null | tail -1 > "$work/datasets.json"
"$python" - "$work" "$started" "$ended" <<'PY'
import json, sys
from pathlib import Path
work, t0, t1 = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
ours = json.loads((work / "ddpjob.json").read_text().strip().splitlines()[-1])
secs = t1 - t0
rss = int((work / "ddpjob-rss").read_text().split()[-1]) * 1024
ref = json.loads((work / "datasets.json").read_text())
print(f"{'':20}{'ddpjob':>12}{'datasets.map':>14}{'ratio':>8}")
# Every row of the shards was read and tokenised (the validation fraction too).
rate = ref["rows"] / secs
print(f"{'rows':20}{ref['rows']:12d}{ref['rows']:14d}")
print(f"{'train tokens':20}{ours['tokens']:12d}{ref['tokens']:14d}  (datasets: every row)")
print(f"{'seconds':20}{secs:12.2f}{ref['seconds']:14.2f}")
print(f"{'rows/s':20}{rate:12.0f}{ref['rows_per_s']:14.0f}{rate / ref['rows_per_s']:8.2f}")
print(f"{'peak RSS MB':20}{rss / 1e6:12.0f}{ref['peak_rss_bytes'] / 1e6:14.0f}")
PY
