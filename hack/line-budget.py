#!/usr/bin/env python3
"""Fails when a crate's code outside its tests is over its line budget.

    hack/line-budget.py controllers/src 5600 450

Counts, for each file under the crate's `src/`, the lines before its `#[cfg(test)] mod ...`
(a file that is a test module itself, `tests.rs`, counts nothing): the total must stay within
the first number, every file within the second. Prints each file over the second, and the total.
"""
import re
import sys
from pathlib import Path


def production_lines(file: Path) -> int:
    lines = file.read_text().splitlines()
    for i, line in enumerate(lines[:-1]):
        if re.match(r"\s*#\[cfg\(test\)\]\s*$", line) and re.match(
            r"\s*(pub(\([\w:]+\))?\s+)?mod\s+\w+", lines[i + 1]
        ):
            return i
    return len(lines)


def main() -> int:
    src, total_budget, file_budget = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    counts = {
        f: production_lines(f) for f in sorted(src.rglob("*.rs")) if f.stem != "tests"
    }
    total = sum(counts.values())
    over = {f: n for f, n in counts.items() if n > file_budget}
    for f, n in sorted(counts.items(), key=lambda fn: -fn[1])[: 5 if "-v" not in sys.argv else None]:
        print(f"  {n:5} {f}")
    print(f"{src}: {total} lines outside tests (budget {total_budget}), "
          f"largest file {max(counts.values())} (budget {file_budget})")
    for f, n in over.items():
        print(f"{f}: {n} lines outside tests, over {file_budget}", file=sys.stderr)
    if total > total_budget:
        print(f"{src}: {total} lines outside tests, over {total_budget}", file=sys.stderr)
    return 1 if over or total > total_budget else 0


if __name__ == "__main__":
    sys.exit(main())
