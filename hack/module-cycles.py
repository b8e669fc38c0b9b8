#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle.

    hack/module-cycles.py controllers/src

Reads every `crate::` path of every file under the crate's `src/` (in `use` trees, braces
included, and in expressions), maps each file to its module (`a/b.rs` and `a/b/mod.rs` are
`a::b`) and each path to the longest module it names, and reports every cycle of the module
graph (an edge A -> B: A names something of B; a module naming its own submodules, or a parent
module re-exporting, counts too). Test modules (`#[cfg(test)]` to the end of the file) are left
out: tests may reach anywhere. Exit 1 with the cycles printed, 0 with the module count.

Written here rather than installing cargo-modules (its rust-analyzer dependency takes longer to
build than the whole workspace): the crate's paths are simple enough to read as text.
"""
import re
import sys
from pathlib import Path


def module_of(src: Path, file: Path) -> str:
    rel = file.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return "::".join(parts)


def strip(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    cut = re.search(r"#\[cfg\(test\)\]", text)
    return text[: cut.start()] if cut else text


def use_paths(tree: str, prefix: str = ""):
    """Expands a use tree (`a::{b, c::{d}}`) into paths."""
    tree = tree.strip()
    if not tree:
        return
    depth, start, items = 0, 0, []
    for i, ch in enumerate(tree):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(tree[start:i])
            start = i + 1
    items.append(tree[start:])
    if len(items) > 1:
        for item in items:
            yield from use_paths(item, prefix)
        return
    item = items[0].strip()
    m = re.match(r"^([\w:]*?)(::)?\{(.*)\}$", item, flags=re.S)
    if m:
        head = m.group(1)
        yield from use_paths(m.group(3), prefix + head + "::" if head else prefix)
        return
    item = re.sub(r"\s+as\s+\w+$", "", item)
    yield prefix + item


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "controllers/src")
    files = sorted(src.rglob("*.rs"))
    modules = {module_of(src, f) for f in files}
    edges: dict[str, set[str]] = {m: set() for m in modules}

    def resolve(path: str, here: str) -> str | None:
        parts = [p for p in path.split("::") if p]
        if parts and parts[0] == "crate":
            parts = parts[1:]
        elif parts and parts[0] in ("super", "self"):
            base = here.split("::") if here else []
            while parts and parts[0] in ("super", "self"):
                if parts[0] == "super":
                    base = base[:-1]
                parts = parts[1:]
            parts = base + parts
        else:
            return None
        best = None
        for n in range(1, len(parts) + 1):
            candidate = "::".join(parts[:n])
            if candidate in modules:
                best = candidate
        return best

    for f in files:
        here = module_of(src, f)
        text = strip(f.read_text())
        paths = []
        for m in re.finditer(r"\buse\s+((?:crate|super|self)\b[^;]*);", text):
            paths.extend(use_paths(m.group(1)))
        for m in re.finditer(r"\b((?:crate|super)(?:::\w+)+)", text):
            paths.append(m.group(1))
        for p in paths:
            target = resolve(p, here)
            if target is not None and target != here and target != "":
                # A parent naming its own child is structure, not a dependency back up.
                if target.startswith(here + "::") or here == "":
                    continue
                edges[here].add(target)

    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(modules):
        if v not in index:
            visit(v)
    n_edges = sum(len(e) for e in edges.values())
    if sccs:
        print(f"{src}: import circles among {len(modules)} modules ({n_edges} imports):", file=sys.stderr)
        for comp in sccs:
            inside = [f"{a} -> {b}" for a in comp for b in sorted(edges[a]) if b in comp]
            print(f"  circle of {', '.join(comp)}: {'; '.join(inside)}", file=sys.stderr)
        return 1
    print(f"{src}: {len(modules)} modules, {n_edges} imports, no import circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
