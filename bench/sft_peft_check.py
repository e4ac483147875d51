"""Checks an instruction-tuned LoRA job against peft: PeftModel(base + the job's `export --peft`
DIR) scores the job's validation examples (the tokenised ones the job keeps, `jsonl-val.bin`)
with the loss on completion tokens only, and gets the validation loss `ddpjob eval JOB --json`
prints.

    python bench/sft_peft_check.py JOB_DIR ADAPTER_DIR DDPJOB_LOSS [--train-on-prompt]

BASE is the job's `model.init_from` (read from its job.toml). Needs torch, transformers and
peft (see ../shared/bench/README.md); never run in CI.
"""
import struct
import sys
import tomllib
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def examples(path):
    """(tokens, prompt length) per example of ddpjob's stored jsonl split."""
    data = Path(path).read_bytes()
    assert data[:8] == b"DDPJSONL", path
    words = struct.unpack(f"<{(len(data) - 8) // 4}I", data[8:])
    n, body = words[2], words[7:]
    lens, tokens = body[: 2 * n], body[2 * n :]
    out, at = [], 0
    for i in range(n):
        length, prompt = lens[2 * i], lens[2 * i + 1]
        out.append((list(tokens[at : at + length]), prompt))
        at += length
    return out


def main():
    job, adapter, expected = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    on_prompt = "--train-on-prompt" in sys.argv
    config = tomllib.loads((job / "job.toml").read_text())
    base = AutoModelForCausalLM.from_pretrained(
        config["model"]["init_from"], torch_dtype=torch.float32, attn_implementation="eager"
    )
    model = PeftModel.from_pretrained(base, adapter).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, prompt in examples(job / "jsonl-val.bin"):
            ids = torch.tensor([tokens[:-1]])
            targets = torch.tensor(tokens[1:])
            if not on_prompt:
                targets[: max(prompt, 1) - 1] = -100
            logits = model(ids).logits[0]
            loss = torch.nn.functional.cross_entropy(
                logits, targets, ignore_index=-100, reduction="sum"
            )
            total += loss.item()
            count += int((targets != -100).sum())
    mean = total / count
    print(f"peft: validation loss {mean:.6f} over {count} completion tokens; ddpjob {expected:.6f}")
    sys.exit(0 if abs(mean - expected) < 1e-4 else 1)


if __name__ == "__main__":
    main()
