"""The TRL side of bench/dpo-vs-trl.sh: DPO with TRL's DPOTrainer and peft's LoRA on a
LlamaForCausalLM of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 key/value heads,
intermediate 1536, vocabulary 49152, tied embeddings), random weights, the same directory and
pairs ddpjob's job reads.

    python bench/dpo_ref.py prepare DIR TEXT [--layers 30] [--pairs 64]
    python bench/dpo_ref.py train DIR --steps 8 --threads 2 [--precompute]   # one JSON line

`prepare` writes the random weights with `save_pretrained`, copies the tests' byte-level BPE
(tests/fixtures/chat/model, 300 tokens: ids well inside the vocabulary) beside them, cuts TEXT
into pairs {"prompt", "chosen", "rejected"} of about 64 tokens each (a passage, the passage
after it, a passage from elsewhere), and writes ddpjob's job file: LoRA r 16 (alpha 32) on the
seven projections, batch 4 pairs, AdamW at a constant 1e-4 without weight decay, no clipping,
f32, beta 0.1, the sigmoid loss. `train` runs TRL's DPOTrainer the same way (peft's
LoraConfig, the reference the base with the adapters off; `--precompute`:
precompute_ref_log_probs) and prints the median seconds per step after the first two, the
steps' losses and the process's peak RSS.
"""

import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_ref import SMOLLM2  # noqa: E402  the shape bench/llama-vs-transformers.sh uses

HERE = Path(__file__).resolve().parent.parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
JOB = """name = "dpo-bench"
seed = 1
[model]
init_from = "{model}"
block_size = 256
[model.lora]
r = 16
alpha = 32
target_modules = {targets}
[data]
dataset = "jsonl"
train_path = "{train}"
val_path = "{val}"
[train]
objective = "dpo"
epochs = 1
batch_size = 4
optimizer = "adamw"
weight_decay = 0.0
lr = 1e-4
log_every = 1
eval_batches = 1
eval_batch_size = 4
[train.dpo]
beta = 0.1
[checkpoint]
every_epochs = 0
[distributed]
nproc_per_node = 1
"""


def prepare(args):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    work = Path(args.dir)
    model_dir = work / "model"
    config = dict(SMOLLM2, max_position_embeddings=2048)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(model_dir)
    fixture = HERE / "tests/fixtures/chat/model"
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(fixture / name, model_dir / name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(Path(args.text).read_text()[:400_000])["input_ids"]
    piece = 64
    rows = []
    for i in range(args.pairs + 8):
        at = 3 * piece * i
        other = (at * 7919 + 50_000) % (len(ids) - 2 * piece)
        rows.append(
            {
                "prompt": tok.decode(ids[at : at + piece]),
                "chosen": tok.decode(ids[at + piece : at + 2 * piece]),
                "rejected": tok.decode(ids[other : other + piece]),
            }
        )
    for name, part in [("train.jsonl", rows[: args.pairs]), ("val.jsonl", rows[args.pairs :])]:
        with open(work / name, "w") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")
    (work / "job.toml").write_text(
        JOB.format(
            model=model_dir,
            targets=json.dumps(TARGETS),
            train=work / "train.jsonl",
            val=work / "val.jsonl",
        )
    )


def train(args):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    work = Path(args.dir)
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    rows = [json.loads(l) for l in open(work / "train.jsonl")]
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_begin(self, *a, **k):
            if not stamps:
                stamps.append(time.perf_counter())

    cfg = DPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=4,
        max_steps=args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        optim="adamw_torch",
        beta=0.1,
        loss_type="sigmoid",
        max_length=512,
        precompute_ref_log_probs=args.precompute,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = DPOTrainer(
        model=model,
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer.train()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    losses = [h["loss"] for h in trainer.state.log_history if "rewards/margins" in h]
    print(
        json.dumps(
            {
                "step_s": statistics.median(steps[2:]) if len(steps) > 2 else steps[-1],
                "losses": losses,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("dir")
    a.add_argument("text")
    a.add_argument("--layers", type=int, default=0)
    a.add_argument("--pairs", type=int, default=64)
    b = sub.add_parser("train")
    b.add_argument("dir")
    b.add_argument("--steps", type=int, default=8)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--precompute", action="store_true")
    args = p.parse_args()
    {"prepare": prepare, "train": train}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
