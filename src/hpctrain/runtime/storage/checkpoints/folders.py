"""How a checkpoint is committed, so that a kill at any moment leaves a complete one under every name.

A file (`AtomicCheckpointIO`) is written to `.<name>.tmp-<writer>` and renamed over the old one: one
atomic step. A folder (FSDP2: one shard per rank) cannot replace another in one rename: every rank
writes into `.<name>.tmp-<token>@<writer>` beside the target; once all have written, rank 0 records the
shard files (`shards.json`: size and a digest of each file's start, which tells a shard from another
checkpoint), sets the old checkpoint aside (`.<name>.old-<token>`), renames the new one into place and
removes what it set aside last.

`committed(path)` is the complete checkpoint under a name whatever the moment of a kill: the name
itself, or, after a kill between the two renames, what was set aside. A restart chooses its start point
through it (`hpctrain.runtime.storage.checkpoints`), so it never needs a repair to happen first, and every
rank, looking at the same folder, chooses the same. `recover` then tidies up on rank 0: it removes an
old checkpoint whose successor is in place, and the unfinished writes of a writer that is gone (this
same SLURM job's earlier attempt, or a dead process of this host); another job's write in progress is
left alone. The writer (`writer_tag`) is part of every temporary name for that reason. No torch here.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from hpctrain.runtime.environment import launched
from hpctrain.runtime.errors import UserError

log = logging.getLogger(__package__)

SHARDS_FILE = "shards.json"
DIGEST_BYTES = 1 << 16
_ASIDE, _STAGING, _WRITER = ".old-", ".tmp-", "@"


class CheckpointNotSaved(UserError):
    """A save that failed: the run stops, and every checkpoint it had committed stays as it was."""

    def __init__(self, path: str | Path, err: BaseException) -> None:
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        super().__init__(
            f"the checkpoint {path} could not be saved ({type(err).__name__}: {reason}), so the run stopped; the "
            f"checkpoints it saved before are kept: make room in {Path(path).parent} (or fix its filesystem) and run "
            "the same command again, which continues from the newest of them."
        )


def start_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read(DIGEST_BYTES)).hexdigest()


def record_shards(folder: Path) -> None:
    """What a reader later compares: each shard file's size and the digest of its start."""
    shards = {
        p.name: [p.stat().st_size, start_digest(p)] for p in sorted(folder.iterdir()) if p.suffix == ".distcp"
    }
    (folder / SHARDS_FILE).write_text(json.dumps(shards, indent=1))


def writer_tag(env: dict[str, str] | None = None) -> str:
    """Who writes a temporary file or folder: this SLURM job (any attempt), else this host's process."""
    job = launched.slurm_job_id(env)
    return f"slurm{job}" if job else f"{socket.gethostname()}.{os.getpid()}"


def staging_path(path: Path, token: str, tag: str | None = None) -> Path:
    return path.with_name(f".{path.name}{_STAGING}{token}{_WRITER}{tag or writer_tag()}")


def temporary_file(path: Path) -> Path:
    return path.with_name(f".{path.name}{_STAGING}{writer_tag()}")


def _asides(path: Path) -> list[Path]:
    found = path.parent.glob(f".{glob.escape(path.name)}{_ASIDE}*")
    return sorted(found, key=lambda p: p.stat().st_mtime)


def committed(path: str | Path) -> Path | None:
    """The complete checkpoint under `path`'s name: the path, or the one a commit killed between its two
    renames had set aside; None if neither exists."""
    path = Path(path)
    if path.exists():
        return path
    asides = _asides(path)
    return asides[-1] if asides else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def commit_folder(staging: Path, path: Path, token: str) -> None:
    """Move a finished checkpoint folder into place. What it replaces (a folder, or a file of the same
    name) is set aside first and removed only once the new one is in place, with any other checkpoint
    an earlier killed commit had set aside under this name."""
    aside = path.with_name(f".{path.name}{_ASIDE}{token}")
    if path.exists() or path.is_symlink():
        os.rename(path, aside)
    os.rename(staging, path)
    _fsync_dir(path.parent)
    for old in _asides(path):
        _remove(old)


def _abandoned(name: str, env: dict[str, str] | None = None) -> bool:
    """Whether the writer named in a temporary name is gone: this SLURM job's earlier attempt (a job
    restarts only once its attempt ended), or a process of this host that no longer runs."""
    tag = name.rpartition(_WRITER)[2] if _WRITER in name else name.rpartition(_STAGING)[2]
    job = launched.slurm_job_id(env)
    if tag.startswith("slurm"):
        return job is not None and tag == f"slurm{job}"
    host, _, pid = tag.rpartition(".") if not tag.isdigit() else (socket.gethostname(), "", tag)
    return launched.process_is_gone(host, pid)


def recover(folder: Path, env: dict[str, str] | None = None) -> None:
    """Rank 0, before the start point is used: remove checkpoints set aside whose successor is in place,
    and unfinished writes whose writer is gone (`_abandoned`). A checkpoint set aside with nothing in
    its place is kept: `committed` finds it, and the next commit of that name removes it."""
    if not folder.is_dir():
        return
    for aside in folder.glob(f".*{_ASIDE}*"):
        name = aside.name[1:].rsplit(_ASIDE, 1)[0]
        if (folder / name).exists():
            _remove(aside)
    for staging in folder.glob(f".*{_STAGING}*"):
        if _abandoned(staging.name, env):
            _remove(staging)
        else:
            log.info("left %s alone: another job's or process's save may still be writing it", staging)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
