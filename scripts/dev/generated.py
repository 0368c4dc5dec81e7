"""Files generated from the code (the editor schemas, the docs' reference pages): written, or checked."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def write_or_check(root: Path, render: Callable[[], dict[str, str]], description: str, script: str) -> int:
    """`render()` gives each file's path (relative to `root`) and text. Without --check, write the files
    that differ; with it, exit 1 naming the stale ones and the command that rewrites them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        path = root / name
        if path.is_file() and path.read_text() == text:
            continue
        if args.check:
            stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {name}")
    if stale:
        print(f"error: {', '.join(stale)} out of date; run python {script}.", file=sys.stderr)
        return 1
    return 0
