"""The Python side of bench/tokenize-vs-datasets.sh.

    python bench/tokenize_ref.py prepare WORK TEXT --mb 50 [--kind chat|text]
    python bench/tokenize_ref.py datasets WORK --procs N
    python bench/tokenize_ref.py trl WORK --procs N

`prepare` writes WORK/tok/ (a byte-level BPE of 32,768 tokens trained on TEXT with ChatML's
special tokens, `chat_template.jinja` with generation markers, as tests/fixtures/chat has) and
WORK/data/train-0000{0..3}-of-00004.parquet: conversations of the text's speeches (a user
speech, the next as the assistant's answer, a system prompt on every third) repeated to about
MB megabytes, written by pyarrow as the Hub's parquet converter writes them (snappy), and
WORK/job.toml, the ddpjob job that reads them. `datasets` tokenises the same shards as a
transformers user does: `load_dataset("parquet")` then `.map(apply_chat_template(...,
return_assistant_tokens_mask=True), batched=True, num_proc=N)`, and prints one JSON line:
rows, seconds, rows/s and the peak RSS of the process and its workers.

`--kind text` writes documents instead: a `text` column of the speeches (one a row, as
wikitext's rows are paragraphs), which ddpjob reads as one corpus of token windows
(`data.text_rows = "windows"`, parquet's default for it), and `datasets` tokenises as
run_clm.py does: `.map(lambda b: tokenizer(b["text"]), batched=True, num_proc=N)`.

`trl` times TRL's own preprocessing of the conversations: `SFTTrainer(...)` with
`SFTConfig(assistant_only_loss=True, dataset_num_proc=N, max_length=1024)` over the same
shards (a one-layer llama of the tokenizer's vocabulary beside it), from `load_dataset` to the
trainer's tokenised `train_dataset`; needs torch and trl.
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

TEMPLATE = (Path(__file__).resolve().parent.parent / "tests/fixtures/chat/templates/chatml.jinja")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def speeches(text):
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) >= 2 and lines[0].endswith(":"):
            out.append(" ".join(lines[1:]))
    return out


def prepare(args):
    import pyarrow as pa
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    work = Path(args.work)
    text = Path(args.text).read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32768, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE.read_text()
    fast.save_pretrained(work / "tok")
    said = speeches(text)
    (work / "kind").write_text(args.kind)
    if args.kind == "text":
        one = sum(len(r) for r in said)
        rows = said * max(1, round(args.mb * 1e6 / one))
        write(work, rows, "text", pa.schema([("text", pa.string())]))
    else:
        rows = []
        for i in range(0, len(said) - 1, 2):
            m = [{"role": "user", "content": said[i]},
                 {"role": "assistant", "content": said[i + 1]}]
            if len(rows) % 3 == 0:
                m.insert(0, {"role": "system", "content": "You answer as a citizen of Rome."})
            rows.append(m)
        one = sum(len(json.dumps(r)) for r in rows)
        rows = rows * max(1, round(args.mb * 1e6 / one))
        message = pa.struct([("role", pa.string()), ("content", pa.string())])
        write(work, rows, "messages", pa.schema([("messages", pa.list_(message))]))


def write(work, rows, column, schema):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (work / "data").mkdir(parents=True, exist_ok=True)
    quarter = (len(rows) + 3) // 4
    for s in range(4):
        part = rows[s * quarter:(s + 1) * quarter]
        pq.write_table(pa.table({column: part}, schema=schema),
                       work / "data" / f"train-{s:05d}-of-00004.parquet", compression="snappy")
    (work / "job.toml").write_text(f"""# made by bench/tokenize_ref.py prepare
name = "tokenize-bench"
[model]
arch = "gpt"
block_size = 1024
n_layer = 1
n_head = 1
n_embd = 8
[data]
dataset = "parquet"
train_path = "{work}/data/train-*.parquet"
val_fraction = 0.01
tokenizer = "{work}/tok/tokenizer.json"
[train]
epochs = 1
batch_size = 1
max_steps = 1
# One evaluation batch: the job's time is its tokenising, not a full validation pass.
eval_batches = 1
eval_batch_size = 1
[checkpoint]
every_epochs = 0
""")
    print(json.dumps({"rows": len(rows), "bytes": sum(f.stat().st_size for f in (work / "data").iterdir())}))


def run_datasets(args):
    from datasets import load_dataset
    from transformers import AutoTokenizer

    work = Path(args.work)
    started = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(work / "tok")
    files = sorted(str(p) for p in (work / "data").glob("train-*.parquet"))
    ds = load_dataset("parquet", data_files=files, split="train", cache_dir=str(work / "hf-cache"))

    def tokenize(batch):
        out = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    def tokenize_text(batch):
        return {"input_ids": tok(batch["text"])["input_ids"]}

    kind = (work / "kind").read_text() if (work / "kind").exists() else "chat"
    column, how = {"chat": ("messages", tokenize), "text": ("text", tokenize_text)}[kind]
    done = ds.map(how, batched=True, num_proc=args.procs, remove_columns=[column],
                  load_from_cache_file=False)
    secs = time.perf_counter() - started
    tokens = sum(len(x) for x in done["input_ids"])
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    print(json.dumps({"rows": len(done), "tokens": tokens, "seconds": secs,
                      "rows_per_s": len(done) / secs, "peak_rss_bytes": peak}))


def run_trl(args):
    from datasets import disable_caching, load_dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    work = Path(args.work)
    tok = AutoTokenizer.from_pretrained(work / "tok")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=8, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    # Every map computed afresh, as datasets.map's load_from_cache_file=False does above.
    disable_caching()
    started = time.perf_counter()
    files = sorted(str(p) for p in (work / "data").glob("train-*.parquet"))
    ds = load_dataset("parquet", data_files=files, split="train", cache_dir=str(work / "hf-cache"))
    cfg = SFTConfig(output_dir=str(work / "trl-out"), dataset_num_proc=args.procs,
                    assistant_only_loss=True, max_length=1024, packing=False, report_to=[],
                    use_cpu=True, bf16=False)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    secs = time.perf_counter() - started
    done = trainer.train_dataset
    tokens = sum(len(x) for x in done["input_ids"])
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    print(json.dumps({"rows": len(done), "tokens": tokens, "seconds": secs,
                      "rows_per_s": len(done) / secs, "peak_rss_bytes": peak}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("work")
    a.add_argument("text")
    a.add_argument("--mb", type=float, default=50)
    a.add_argument("--kind", choices=["chat", "text"], default="chat")
    b = sub.add_parser("datasets")
    b.add_argument("work")
    b.add_argument("--procs", type=int, default=2)
    c = sub.add_parser("trl")
    c.add_argument("work")
    c.add_argument("--procs", type=int, default=2)
    args = p.parse_args()
    {"prepare": prepare, "datasets": run_datasets, "trl": run_trl}[args.cmd](args)
