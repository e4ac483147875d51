"""Checks a ddpjob LoRA export against peft: PeftModel(base + `export --peft` DIR) gives the
logits of ddpjob's `export --hf --merge-lora` DIR, and the adapter changes the base's.

    python bench/peft_check.py BASE_DIR ADAPTER_DIR MERGED_DIR

Needs torch, transformers and peft (see ../shared/bench/README.md); never run in CI.
"""
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

base_dir, adapter_dir, merged_dir = sys.argv[1:4]
base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
peft = PeftModel.from_pretrained(base, adapter_dir).eval()
merged = AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
torch.manual_seed(0)
ids = torch.randint(0, base.config.vocab_size, (4, 16))
with torch.no_grad():
    with_adapter = peft(ids).logits
    folded = merged(ids).logits
    with peft.disable_adapter():
        without = peft(ids).logits
diff = (with_adapter - folded).abs().max().item()
effect = (with_adapter - without).abs().max().item()
print(f"peft (base + adapter) vs merged export: max |logit diff| {diff:.2e}")
print(f"the adapter's effect on the logits: max |diff| {effect:.3f}")
sys.exit(0 if diff < 1e-4 and effect > 1e-3 else 1)
