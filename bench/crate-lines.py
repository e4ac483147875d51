#!/usr/bin/env python3
"""Rust lines per crate of the workspace at a revision, tests and examples aside (`tests.rs`
files, `tests/` folders, an inline `#[cfg(test)] mod tests` to the end of its file, `tests/`,
`examples/`, `vendor/`, `bench/`): what issue 64's "no crate holds more than 40%" counts.

    python3 bench/crate-lines.py            # HEAD
    python3 bench/crate-lines.py 2ae961e    # the last single-crate revision
"""
import collections
import os
import re
import subprocess
import sys

repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"


def git(*args):
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout


lines = collections.Counter()
for f in git("ls-tree", "-r", "--name-only", rev).split():
    if not f.endswith(".rs") or not f.startswith(("src/", "crates/")):
        continue
    if f.endswith("tests.rs") or "/tests/" in f:
        continue
    text = git("show", f"{rev}:{f}")
    test_module = re.search(r"\n#\[cfg\(test\)\]\s*\n(pub(\(crate\))? )?mod tests", text)
    if test_module:
        text = text[: test_module.start()]
    crate = f.split("/")[1] if f.startswith("crates/") else "ddpjob (src/)"
    lines[crate] += text.count("\n")
total = sum(lines.values())
for crate, n in lines.most_common():
    print(f"{n:6d} {100 * n / total:5.1f}% {crate}")
print(f"{total:6d} total")
