"""Makes examples/sft/shakespeare.jsonl, the instruction data of configs/sft-lora.toml, from the
tiny Shakespeare text: each example's prompt is one speech and the next speaker's name, its
completion that speaker's reply (both at most three lines), so a model learns to answer in role.

    python3 examples/sft/make_shakespeare_sft.py path/to/tinyshakespeare/input.txt
"""

import json
import sys

MAX_LINES = 3
EXAMPLES = 1200


def speeches(text):
    """(speaker, lines) for every block of the play text."""
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) >= 2 and lines[0].endswith(":"):
            yield lines[0][:-1], lines[1:]


def main():
    source = sys.argv[1] if len(sys.argv) > 1 else "../shared/data/tinyshakespeare/input.txt"
    with open(source, encoding="utf-8") as f:
        blocks = list(speeches(f.read()))
    out = []
    for (who, said), (other, reply) in zip(blocks, blocks[1:]):
        if len(said) > MAX_LINES or len(reply) > MAX_LINES or who == other:
            continue
        prompt = f"{who}:\n" + "\n".join(said) + f"\n\n{other}:\n"
        out.append({"prompt": prompt, "completion": "\n".join(reply)})
        if len(out) == EXAMPLES:
            break
    with open("examples/sft/shakespeare.jsonl", "w", encoding="utf-8") as f:
        for example in out:
            f.write(json.dumps(example) + "\n")
    print(f"{len(out)} examples")


if __name__ == "__main__":
    main()
