#!/usr/bin/env python3
"""Fails when the modules of a crate import against their declared order, or in a circle.

    hack/module-cycles.py controllers/src

Reads every `crate::` path of every file under the crate's `src/` (in `use` trees, braces
included, and in expressions), maps each file to its module (`a/b.rs` and `a/b/mod.rs` are
`a::b`) and each path to the longest module it names (an edge A -> B: A names something of B; a
module naming its own submodules, or a parent module re-exporting, counts too). Test modules
(from the `#[cfg(test)]` line before a `mod` to the end of the file) are left out: tests may
reach anywhere; a `#[cfg(test)]` item elsewhere does not end the production code.

The order: `lib.rs`'s doc lists the top-level modules in layers, one list item per layer, lowest
first, each item starting with its modules in backticks (`` //! - `a`, `b`: what they are ``).
A module may import its own layer's and lower layers' modules, never a higher layer's; within a
layer, and among a module's submodules, no circle. Exit 1 with each offending import printed,
0 with the module count.

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
    cut = re.search(r"#\[cfg\(test\)\]\s*(pub(\([\w:]+\))?\s+)?mod\s+\w+", text)
    return text[: cut.start()] if cut else text


def layers(lib: Path) -> list[list[str]]:
    """The declared layers: the doc's list items, each one's leading backticked names."""
    out = []
    for line in lib.read_text().splitlines():
        m = re.match(r"^//!\s*-\s*((?:\[?`[\w:]+`\]?(?:\s*,\s*|\s+and\s+)?)+)", line)
        if m:
            out.append(re.findall(r"`([\w:]+)`", m.group(1)))
    return out


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
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src = Path(args[0] if args else "controllers/src")
    files = sorted(src.rglob("*.rs"))
    modules = {module_of(src, f) for f in files}
    # The root's re-exports (`pub use a::{B, C}`): `crate::B` names module `a`.
    reexports = {}
    for m in re.finditer(r"pub use ([^;]+);", strip((src / "lib.rs").read_text())):
        for p in use_paths(m.group(1)):
            parts = p.split("::")
            if len(parts) > 1:
                reexports[parts[-1]] = parts[0]
    edges: dict[str, set[str]] = {m: set() for m in modules}

    def resolve(path: str, here: str) -> str | None:
        parts = [p for p in path.split("::") if p]
        if parts and parts[0] == "crate":
            parts = parts[1:]
            if parts and parts[0] in reexports:
                parts = [reexports[parts[0]]] + parts[1:]
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
        if here.split("::")[-1] == "tests":
            continue  # a test module in a file of its own
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
    if "--graph" in sys.argv:
        for a in sorted(edges):
            print(a, "->", ", ".join(sorted(edges[a])))
    declared = layers(src / "lib.rs")
    placed = {m: i for i, names in enumerate(declared) for m in names}

    def layer_of(module):
        """The layer of the longest declared prefix of `module`, and that prefix."""
        parts = module.split("::")
        for n in range(len(parts), 0, -1):
            name = "::".join(parts[:n])
            if name in placed:
                return placed[name], name
        return None, None

    unplaced = sorted(m for m in modules if m and layer_of(m)[0] is None)
    against = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            (la, na), (lb, nb) = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                against.append(f"  {a} -> {b}: `{nb}` is listed after `{na}`")
    if unplaced or against:
        if unplaced:
            print(f"{src}/lib.rs: modules not in the declared order: {', '.join(unplaced)}", file=sys.stderr)
        if against:
            print(f"{src}: imports against the declared order (lib.rs):", file=sys.stderr)
            print("\n".join(against), file=sys.stderr)
        return 1
    if sccs:
        print(f"{src}: import circles among {len(modules)} modules ({n_edges} imports):", file=sys.stderr)
        for comp in sccs:
            inside = [f"{a} -> {b}" for a in comp for b in sorted(edges[a]) if b in comp]
            print(f"  circle of {', '.join(comp)}: {'; '.join(inside)}", file=sys.stderr)
        return 1
    print(f"{src}: {len(modules)} modules in {len(declared)} layers, {n_edges} imports, "
          "none against the declared order, no import circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
