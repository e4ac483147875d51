"""The transformers side of bench/llama-vs-transformers.sh: a LlamaForCausalLM of SmolLM2-135M's
shape (30 layers, hidden 576, 9 heads, 3 key/value heads, intermediate 1536, vocabulary 49152),
trained and evaluated as ddpjob's job does, from the same weights on the same windows.
`--shape qwen3-0.6b`: a Qwen3ForCausalLM of Qwen3-0.6B's shape (28 layers, hidden 1024, 16
heads, 8 key/value heads, head_dim 128, intermediate 3072, vocabulary 151,936, context 512);
`--shape qwen3-moe`: a small Qwen3MoeForCausalLM (8 layers, hidden 512, 8 heads, 4 key/value
heads, 64 experts of width 256, 8 per token, renormalised, vocabulary 151,936, context 256).

    python bench/llama_ref.py prepare DIR TEXT [--layers 30] [--shape smollm2]
    python bench/llama_ref.py train DIR --steps 10 --threads 2  # one JSON line
    python bench/llama_ref.py train DIR --lora 16               # peft's LoRA (all 7 projections)
    python bench/llama_ref.py train DIR --device cuda --precision bf16 --attn sdpa --batch 32

`prepare` writes random weights of that shape with `save_pretrained` (the directory ddpjob's
job starts from), trains a byte-level BPE of 8,000 tokens on TEXT and writes the tokenised
text as ddpjob's `tokens` data (u16), and the job file. `train` replays ddpjob's batches:
`tokens` data cuts an epoch's windows every `block_size` tokens from a phase drawn from (seed,
epoch), and the sampler orders them as torch's DistributedSampler (randperm seeded with seed +
epoch). AdamW (no weight decay), gradient clipping at 1.0, eager attention, f32, the loss of
each step, then the validation split scored under `torch.no_grad()` as ddpjob's `eval` scores it.
`--device cuda --precision bf16`: f32 weights with `torch.autocast` to bf16, as ddpjob's
`train.precision = "bf16"` keeps f32 master weights (and as the HF Trainer's `bf16=True` does);
each step's time ends once the device has finished it. `--attn sdpa` is transformers' default
attention (fused kernels on a GPU); `--batch` the job's per-step batch (`--set train.batch_size`).
`--precision bf16-matmul`: f32, with the matrix products' inputs in bf16 and f32 sums, as
ddpjob's `train.precision = "bf16-matmul"`: `torch.set_float32_matmul_precision("medium")` and
oneDNN's `torch.backends.mkldnn.matmul.fp32_precision = "bf16"` (its bf16 products on CPUs
with AVX512_BF16; TF32 on a GPU).
`--compile`: the model under `torch.compile` and AdamW fused on a GPU (nanoGPT's set-up; the
first 20 steps, compilation, left out of the tokens/s), for bench/compile-vs-torch.sh.
`--lora R`: the model wrapped by peft (`LoraConfig(r=R, lora_alpha=2R)` on the seven projections,
as ddpjob's `[model.lora]` of bench/lora-vs-peft.sh), only the adapters given to AdamW.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

MASK = (1 << 64) - 1
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN3_MOE = dict(
    vocab_size=151936,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# name: (config class, sizes, block, batch)
SHAPES = {
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", SMOLLM2, 256, 4),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_06B, 512, 1),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE, 256, 4),
}
BLOCK, BATCH, LR, SEED = 256, 4, 3e-4, 0


def sample_seed(seed, epoch, index):
    """ddpjob's `task::sample_seed` (splitmix64's finaliser over seed, epoch and index)."""
    z = (seed * 0x9E3779B97F4A7C15) & MASK
    z = (z + (epoch << 40)) & MASK
    z = (z + index) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def train_windows(n, block):
    return 0 if n < block + 1 else max((n - block) // block, 1)


def phase(n, block, seed, epoch):
    """The offset of an epoch's windows (`TextTask::phase`)."""
    windows = train_windows(n, block)
    slack = n - 1 - windows * block
    phases = min(slack, block - 1) + 1
    return sample_seed(seed ^ 0x0070_6861_7365, epoch, MASK) % phases


def prepare(args):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    global BLOCK, BATCH
    config_class, model_class, sizes, BLOCK, BATCH = SHAPES[args.shape]

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(args.text).read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    # ddpjob reads token files of the model's vocabulary: u32 past 65,536 tokens.
    wide = sizes["vocab_size"] > 65536
    ids = np.array(tok.encode(text).ids, dtype=np.uint32 if wide else np.uint16)
    split = int(len(ids) * 0.9)
    ids[:split].tofile(out / "train.bin")
    # The validation split: 64 windows, scored whole.
    ids[split : split + 64 * BLOCK + 1].tofile(out / "val.bin")
    torch.manual_seed(SEED)
    layers = args.layers if args.layers else sizes["num_hidden_layers"]
    config = getattr(transformers, config_class)(**{**sizes, "num_hidden_layers": layers})
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(out / "model", safe_serialization=True)
    tok.save(str(out / "model" / "tokenizer.json"))
    (out / "job.toml").write_text(
        f"""# made by bench/llama_ref.py prepare
name = "llama-bench"
seed = {SEED}
[model]
init_from = "{out / 'model'}"
block_size = {BLOCK}
[data]
dataset = "tokens"
token_dtype = "{'u32' if wide else 'u16'}"
train_path = "{out / 'train.bin'}"
val_path = "{out / 'val.bin'}"
[train]
epochs = 1
max_steps = 10
batch_size = {BATCH}
lr = {LR}
optimizer = "adamw"
weight_decay = 0.0
betas = [0.9, 0.95]
grad_clip_norm = 1.0
log_every = 1
eval_batch_size = 8
[checkpoint]
every_epochs = 0
keep_last = 0
"""
    )
    print(json.dumps({"train_tokens": split, "parameters": sum(p.numel() for p in model.parameters())}))


def train(args):
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    # The job's window and batch (prepare wrote them).
    global BLOCK
    job = (Path(args.dir) / "job.toml").read_text()
    BLOCK = int(job.split("block_size = ")[1].split()[0])
    if args.batch is None:
        args.batch = int(job.split("batch_size = ")[1].split()[0])

    torch.set_num_threads(args.threads)
    if args.precision == "bf16-matmul":
        torch.set_float32_matmul_precision("medium")
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    device = torch.device(args.device)
    batch = args.batch

    def autocast():
        if args.precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return nullcontext()

    def finished():
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
    d = Path(args.dir)
    wide = 'token_dtype = "u32"' in job
    dtype = np.uint32 if wide else np.uint16
    train_ids = torch.from_numpy(np.fromfile(d / "train.bin", dtype=dtype).astype(np.int64))
    val_ids = torch.from_numpy(np.fromfile(d / "val.bin", dtype=dtype).astype(np.int64))
    started = time.perf_counter()
    extra = {"experts_implementation": args.experts} if args.experts else {}
    model = AutoModelForCausalLM.from_pretrained(
        d / "model", attn_implementation=args.attn, dtype=torch.float32, **extra
    ).to(device)
    load_s = time.perf_counter() - started
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=targets,
                            lora_dropout=0.0, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    parameters = sum(p.numel() for p in model.parameters())
    # --compile: nanoGPT's GPU set-up, the model compiled and AdamW fused; the first 20 steps
    # (compilation) are left out of the timing.
    fused = {"fused": True} if args.compile and device.type == "cuda" else {}
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **fused)
    net = torch.compile(model) if args.compile else model
    n = len(train_ids)
    windows = train_windows(n, BLOCK)
    losses, times = [], []
    model.train()
    step, epoch = 0, 0
    while step < args.steps:
        g = torch.Generator()
        g.manual_seed(SEED + epoch)
        order = torch.randperm(windows, generator=g).tolist()
        start0 = phase(n, BLOCK, SEED, epoch)
        for b in range(0, windows - batch + 1, batch):
            if step >= args.steps:
                break
            starts = [start0 + i * BLOCK for i in order[b : b + batch]]
            rows = torch.stack([train_ids[s : s + BLOCK + 1] for s in starts]).to(device)
            x, y = rows[:, :-1], rows[:, 1:]
            t0 = finished()
            with autocast():
                logits = net(x).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            times.append(finished() - t0)
            losses.append(loss.item())
            step += 1
        epoch += 1
    model.eval()
    # ddpjob's validation windows: from 0, every BLOCK tokens, each BLOCK + 1 long.
    starts = list(range(0, len(val_ids) - BLOCK, BLOCK))
    started = finished()
    total, count = 0.0, 0
    with torch.no_grad(), autocast():
        for b in range(0, len(starts), 8):
            rows = torch.stack([val_ids[s : s + BLOCK + 1] for s in starts[b : b + 8]]).to(device)
            logits = model(rows[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += rows[:, 1:].numel()
    eval_s = finished() - started
    timed = times[20 if args.compile else 2 :] or times
    print(
        json.dumps(
            {
                "losses": losses,
                "train_tokens_per_s": batch * BLOCK / statistics.median(timed),
                "eval_loss": total / count,
                "eval_tokens": count,
                "eval_tokens_per_s": count / eval_s,
                "load_s": load_s,
                "parameters": parameters,
                "compiled": args.compile,
            }
        )
    )


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("dir")
    a.add_argument("text")
    a.add_argument("--layers", type=int, default=0, help="default: the shape's")
    a.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    b = sub.add_parser("train")
    b.add_argument("dir")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--lora", type=int, default=0)
    b.add_argument("--device", default="cpu")
    b.add_argument("--precision", choices=["f32", "bf16", "bf16-matmul"], default="f32")
    b.add_argument("--attn", choices=["eager", "sdpa"], default="eager")
    b.add_argument("--batch", type=int, default=None, help="default: the job's")
    b.add_argument("--compile", action="store_true",
                   help="torch.compile the model, fused AdamW on a GPU (20 steps of warm-up untimed)")
    b.add_argument("--experts", choices=["eager", "grouped_mm", "batched_mm"], default=None,
                   help="transformers' experts_implementation (default: its own choice)")
    args = p.parse_args()
    {"prepare": prepare, "train": train}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
