"""Checkpoint folders (one shard per rank) committed atomically, and put right after a kill.

Every rank writes into `.<name>.tmp-<token>` beside the target; once all have written, rank 0 records
the shard files (`shards.json`: size and a digest of each file's start, which tells a shard from
another checkpoint) and moves the folder into place. A folder cannot replace another in one rename,
so the old one is set aside first (`.<name>.old-<token>`) and removed last; `recover`, at the start of
the next attempt, puts it back if a kill fell between the two renames. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__package__)

SHARDS_FILE = "shards.json"
DIGEST_BYTES = 1 << 16


def start_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read(DIGEST_BYTES)).hexdigest()


def record_shards(folder: Path) -> None:
    """What a reader later compares: each shard file's size and the digest of its start."""
    shards = {
        p.name: [p.stat().st_size, start_digest(p)] for p in sorted(folder.iterdir()) if p.suffix == ".distcp"
    }
    (folder / SHARDS_FILE).write_text(json.dumps(shards, indent=1))


def commit_folder(staging: Path, path: Path, token: str) -> None:
    """Move a finished checkpoint folder into place; the one it replaces is set aside first and removed
    last, so at every moment a complete checkpoint exists (`recover` puts one back after a kill between
    the two renames)."""
    aside = path.with_name(f".{path.name}.old-{token}")
    if path.is_dir():
        os.rename(path, aside)
    elif path.exists():
        path.unlink()
    os.rename(staging, path)
    _fsync_dir(path.parent)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)


def recover(folder: Path) -> None:
    """After a kill: a checkpoint set aside (`.<name>.old-*`) whose replacement never arrived goes back;
    unfinished folders (`.<name>.tmp-*`) are removed."""
    if not folder.is_dir():
        return
    for aside in folder.glob(".*.old-*"):
        name = aside.name[1:].rsplit(".old-", 1)[0]
        target = folder / name
        if not target.exists():
            os.rename(aside, target)
            log.warning("restored %s, which a save killed mid-way had set aside", target)
        else:
            shutil.rmtree(aside, ignore_errors=True)
    for staging in folder.glob(".*.tmp-*"):
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
