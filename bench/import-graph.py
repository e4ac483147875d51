#!/usr/bin/env python3
"""The import graph inside each crate of the workspace: which files name which (`crate::a::b`,
`super::x`, `self::y` paths in code, not in comments), its strongly connected components, and
those that span more than one folder (the circles issue 64 asks to be rid of).

    python3 bench/import-graph.py            # one line per crate, then each circle found
    python3 bench/import-graph.py --edges    # every edge too
    python3 bench/import-graph.py --root DIR # another checkout's

Exits 1 when a circle spans more than one folder.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if "--root" in sys.argv:  # another checkout (`git worktree add`), e.g. an older revision
    ROOT = sys.argv[sys.argv.index("--root") + 1]


def crates():
    yield "ddpjob", os.path.join(ROOT, "src")
    base = os.path.join(ROOT, "crates")
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        src = os.path.join(base, name, "src")
        if os.path.isdir(src):
            yield name, src


def modules(src):
    """Module path (tuple) -> file, for every .rs file under src (tests files included: a test
    module is a module like another)."""
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("lib", "main", "mod"):
                parts = parts[:-1]
            out[tuple(parts)] = os.path.join(dirpath, f)
    return out


def folder(mods, m):
    """The folder a module belongs to: its parent's, or its own when it has modules of its
    own besides its tests (`gpt.rs` beside `gpt/` is the `gpt` folder's)."""
    children = [o for o in mods if len(o) == len(m) + 1 and o[: len(m)] == m]
    own = any(not o[-1].endswith("tests") for o in children)
    return "/".join(m if own else m[:-1]) or "."


def strip_comments(text):
    # An inline test module (at the end of its file, by the house style) is its file's child:
    # its `super` is the file, not the file's parent. Left out; `tests.rs` files are counted.
    test_module = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod tests\s*\{", text)
    if test_module:
        text = text[: test_module.start()]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.split("\n"))


PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE = re.compile(r"\buse\s+([^;]+);", re.S)


def expand(tree):
    """`a::{b, c::{d, e as f}}` -> [(b, [a, b]), (d, [a, c, d]), (f, [a, c, e])]; a glob's
    name is `*`."""
    tree = re.sub(r"\s+as\s+", "@", tree)
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, t):
        if "{" in t and t.endswith("}"):
            head, inner = t.split("{", 1)
            depth, item, items = 0, "", []
            for ch in inner[:-1]:
                depth += ch == "{"
                depth -= ch == "}"
                if ch == "," and depth == 0:
                    items.append(item)
                    item = ""
                else:
                    item += ch
            items.append(item)
            base = prefix + [p for p in head.split("::") if p]
            for it in items:
                if it:
                    walk(base, it)
            return
        t, _, alias = t.partition("@")
        full = prefix + [p for p in t.split("::") if p]
        if full and full[-1] == "self":
            full = full[:-1]
        out.append((alias or (full[-1] if full else ""), full))

    walk([], tree)
    return out


def uses(text):
    """What a file's `use` items name: {name: path}, `*` for globs (a list)."""
    named, globs = {}, []
    for tree in USE.findall(text):
        tree = re.sub(r"^pub(\([^)]*\))?\s+", "", tree.strip())
        for name, path in expand(tree):
            if name == "*":
                globs.append(path[:-1])
            else:
                named[name] = path
    return named, globs


def resolve(mods, table, here, path, depth=0):
    """The module a path (`crate::a::b::Item`, `super::x`, `self::y`) reaches, following the
    `use` items of the module it stops in (a re-export names where the item lives); `None`
    for another crate's."""
    if not path:
        return None
    head, rest = path[0], list(path[1:])
    if head == "crate":
        base = []
    elif head == "super":
        base = list(here[:-1])
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    elif head == "self":
        base = list(here)
    elif tuple(here) + (head,) in mods:
        # A child module named bare (`use gpt::X` in lib.rs, `use options::Y` in llama/).
        return resolve(mods, table, here, ["self", head] + rest, depth)
    else:
        return None
    parts = base + rest
    module = []
    while len(module) < len(parts) and tuple(module + [parts[len(module)]]) in mods:
        module.append(parts[len(module)])
    module = tuple(module)
    left = parts[len(module):]
    if left and depth < 8:
        named, globs = table[module]
        if left[0] in named:
            target = named[left[0]]
            return resolve(mods, table, module, target + left[1:], depth + 1)
        for g in globs:
            got = resolve(mods, table, module, g + left, depth + 1)
            if got not in (None, module):
                return got
    return module


def graph(src):
    mods = modules(src)
    texts = {m: strip_comments(open(p, encoding="utf-8").read()) for m, p in mods.items()}
    table = {m: uses(t) for m, t in texts.items()}
    edges = {m: set() for m in mods}
    for m, text in texts.items():
        paths = [[head] + [p for p in rest.split("::") if p] for head, rest in PATH.findall(text)]
        named, globs = table[m]
        paths += list(named.values()) + globs
        for path in paths:
            target = resolve(mods, table, m, path)
            if target is not None and target != m:
                edges[m].add(target)
    # A file is also reached from its parent declaring it (`mod x;`): not an import, left out.
    return mods, edges


def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main():
    show_edges = "--edges" in sys.argv
    bad = 0
    for name, src in crates():
        mods, edges = graph(src)
        circles = [c for c in sccs(edges) if len(c) > 1]
        wide = []
        for c in circles:
            folders = {folder(mods, m) for m in c}
            if len(folders) > 1:
                wide.append((c, folders))
        print(f"{name}: {len(mods)} files, {sum(map(len, edges.values()))} imports, "
              f"{len(circles)} circles, {len(wide)} spanning more than one folder")
        for c, folders in wide:
            bad += 1
            files = sorted(os.path.relpath(mods[m], ROOT) for m in c)
            print(f"  circle of {len(c)} files over {sorted(folders)}:")
            for f in files:
                print(f"    {f}")
        if show_edges:
            for m in sorted(edges):
                for t in sorted(edges[m]):
                    print(f"  {'::'.join(m) or '<root>'} -> {'::'.join(t) or '<root>'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
