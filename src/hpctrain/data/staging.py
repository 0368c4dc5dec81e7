"""A node-local copy of a data set (a shard set's files and manifest) (`data.stage_dir`, e.g. `$SLURM_TMPDIR`), made once per node.

Reading millions of small files, or even a few large ones, from a shared filesystem from every rank of
a job is slow for the job and hard on the filesystem; sites ask for a copy to node-local scratch. Every
process of the job calls `stage` before any process group exists (a copy that takes an hour must not
run into a collective's timeout):

- the copy lives in a folder of the user's own, `<stage_dir>/hpctrain-<user>/` (mode 0700): scratch
  such as /tmp is shared by every user of the node, and a data set someone else put there is not the
  user's data. A folder of that name owned by another user, or one others may write, is refused in one
  sentence;
- the first process on the node to create `<own folder>/.<name>.lock` copies, checking each file's
  sha256 against the manifest while it copies; the node's other processes wait for its marker;
- the marker (`<copy>/.staged.json`: the manifest's digest and every file's size) lets a later attempt
  on the same node reuse the copy, once the copy and each of its files are found to be the user's own
  (in a folder nobody else can write); scratch wiped between attempts means copying again;
- not enough free space is one sentence before anything is copied.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from hpctrain.runtime import confined
from hpctrain.runtime.environment import launched
from hpctrain.runtime.errors import UserError

log = logging.getLogger("hpctrain")
MARKER = ".staged.json"
CHUNK = 1 << 20
POLL_S = 0.5


def stage(
    source: Path, stage_dir: Path, files: Sequence[tuple[str, int, str]], index: str, verify: bool = True
) -> Path:
    """The node-local copy of the data set in `source` (made now, by this process or another on the
    node, or reused from an earlier attempt): `<stage_dir>/<source's name>`. `files` are (path relative
    to `source`, size, sha256); `index` (the manifest listing them) is copied last. `verify=False`: the
    third item is a tag that changes with the file (no manifest records a sha256, as for a model's
    folder), and the copy is not checked against it."""
    if (stage_dir / source.name).resolve() == source.resolve():
        return source  # the data already lies in scratch: read in place
    own = private_folder(stage_dir)
    target = own / source.name
    expected = _marker(files)
    once(
        own / f".{source.name}.lock",
        lambda: _reusable(target, expected),
        lambda: _copy(source, target, files, index, expected, verify),
        f"stage {target}",
    )
    return target


def once(lock: Path, done: Callable[[], bool], make: Callable[[], None], doing: str) -> bool:
    """`make()` run by the first process of the job (on any node sharing `lock`'s folder) to create `lock`
    while `done()` is false; the others wait until it is done, or take over from a holder that died.
    Whether this process made it."""
    waited_since = time.monotonic()
    reported = 0.0
    while not done():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _holder_is_gone(lock):
                lock.unlink(missing_ok=True)  # a process of an earlier attempt died while making it
                continue
            if time.monotonic() - waited_since - reported >= 60:
                reported = time.monotonic() - waited_since
                log.info(
                    "waiting for %s to %s (%.0f s so far)", _read(lock) or "another process", doing, reported
                )
            time.sleep(POLL_S)
            continue
        with os.fdopen(fd, "w") as file:
            file.write(f"{socket.gethostname()} {os.getpid()}\n")
        try:
            if done():  # another process may have finished between our two looks
                return False
            make()
        finally:
            lock.unlink(missing_ok=True)
        return True
    return False


def private_folder(stage_dir: Path) -> Path:
    """`<stage_dir>/hpctrain-<user>`, created with mode 0700, or checked to be this user's alone."""
    own = stage_dir / f"hpctrain-{getpass.getuser()}"
    try:
        stage_dir.mkdir(parents=True, exist_ok=True)
        own.mkdir(mode=0o700, exist_ok=True)
        found = os.lstat(own)
    except OSError as err:
        raise UserError(
            f"data.stage_dir={stage_dir}: its folder {own} cannot be made ({err.strerror or err}); pass a "
            "data.stage_dir you can write (node-local scratch, e.g. $SLURM_TMPDIR), or data.stage_dir=null."
        ) from err
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o022:
        what = (
            "is not a folder"
            if not stat.S_ISDIR(found.st_mode)
            else f"belongs to another user (uid {found.st_uid})"
            if found.st_uid != os.getuid()
            else "may be written by others"
        )
        raise UserError(
            f"data.stage_dir={stage_dir}: {own} {what}, so a staged copy in it could be someone else's data; "
            "nothing was read from it: pass another data.stage_dir (node-local scratch of your own, e.g. "
            "$SLURM_TMPDIR), or remove it if it is yours."
        )
    return own


def _marker(files: Sequence[tuple[str, int, str]]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()
    return {"files_sha256": digest, "files": {name: size for name, size, _ in files}}


def _reusable(target: Path, expected: dict[str, Any]) -> bool:
    try:
        found = confined.read_json(target / MARKER, "record", folder=target)
    except (OSError, ValueError, UserError):
        return False
    if found != expected or not _yours(target):
        return False
    return all(_yours(target / name, size) for name, size in expected["files"].items())


def _yours(path: Path, size: int | None = None) -> bool:
    """A file of `size` bytes (or a folder) this user owns, no link: inside the user's own folder,
    which nobody else can enter, that is a copy this user made."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISREG(found.st_mode) if size is not None else stat.S_ISDIR(found.st_mode)
    return kind and found.st_uid == os.getuid() and (size is None or found.st_size == size)


def _copy(
    source: Path,
    target: Path,
    files: Sequence[tuple[str, int, str]],
    index: str,
    expected: dict[str, Any],
    verify: bool = True,
) -> None:
    if verify:  # names a manifest gives: all of them checked before anything is written
        for name in (*(name for name, _, _ in files), index):
            _check_name(name, source, target)
    needed = sum(size for _, size, _ in files)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).unlink(missing_ok=True)
    free = shutil.disk_usage(target).free + sum(
        (target / name).stat().st_size for name, _, _ in files if (target / name).is_file()
    )
    if needed > free:
        raise UserError(
            f"data.stage_dir={target.parent} has {_size(free)} free but the shards in {source} need "
            f"{_size(needed)}; free space there, or pass data.stage_dir=null to read them in place."
        )
    started = time.monotonic()
    log.info("staging %s (%s) to %s", source, _size(needed), target)
    for name, _size_bytes, sha256 in files:
        _copy_checked(source / name, target / name, sha256 if verify else None)
    shutil.copyfile(source / index, target / index)
    tmp = target / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(expected))
    os.replace(tmp, target / MARKER)
    seconds = time.monotonic() - started
    log.info(
        "staged %.2f GB in %.1f s (%.2f s per GB)", needed / 1e9, seconds, seconds / max(needed / 1e9, 1e-9)
    )


def _check_name(name: str, source: Path, target: Path) -> None:
    """A file the manifest names: a relative, normalised path (no `..`), with no link on the way in the set
    or in the copy, a regular file of the set, whose copy lies inside the copy's folder."""
    parts = PurePosixPath(name).parts
    plain = bool(parts) and not PurePosixPath(name).is_absolute() and str(PurePosixPath(*parts)) == name
    linked = any(
        root.joinpath(*parts[:i]).is_symlink() for root in (source, target) for i in range(1, len(parts))
    )
    if not plain or ".." in parts or linked or not confined.inside(target / name, target):
        raise UserError(
            f"the manifest of {source} names {name!r}, which is no file of the set itself (a path that leaves it, or "
            "a link on the way); nothing was copied: make the shards again with scripts/make_shards.py."
        )
    confined.regular_file(source / name, source)


def _copy_checked(source: Path, target: Path, sha256: str | None) -> None:
    """Copy one file, computing its sha256 on the way; a mismatch is one sentence and no copy (None:
    nothing to compare with)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = target.with_name(target.name + ".tmp")
    buffer = bytearray(CHUNK)  # one buffer, read into: no new chunk to allocate (and fault in) per read
    view = memoryview(buffer)
    with open(source, "rb", buffering=0) as src, open(tmp, "wb", buffering=0) as dst:
        while count := src.readinto(buffer):
            digest.update(view[:count])
            dst.write(view[:count])
    if sha256 is not None and digest.hexdigest() != sha256:
        tmp.unlink()
        raise UserError(
            f"{source} does not match the sha256 its manifest lists (changed or corrupt since it was made); "
            "make the shards again with scripts/make_shards.py."
        )
    os.replace(tmp, target)


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def _read(lock: Path) -> str:
    try:
        return lock.read_text().strip()
    except OSError:
        return ""


def _holder_is_gone(lock: Path) -> bool:
    """Whether the lock was left by a process of this host that no longer runs."""
    host, _, pid = _read(lock).partition(" ")
    if not host:  # created, never written: its process died at once (or is about to write: give it 30 s)
        try:
            return time.time() - lock.stat().st_mtime > 30
        except OSError:
            return False
    return launched.process_is_gone(host, pid)


def stage_folder(folder: str | Path, stage_dir: str | Path) -> Path:
    """A node-local copy of a folder without a manifest (a pretrained model's: config, safetensors,
    tokenizer), made once per node as `stage` makes it; a file is known by its path, size and modification
    time (hashing a 16 GB model on every rank to decide would cost more than the copy), and `config.json`
    or else the largest file's name is copied last."""
    source = Path(folder).expanduser()
    if not source.is_dir():
        raise UserError(f"{source} is not a folder to stage; pass the folder of the model (its config.json).")
    files = sorted(
        (str(p.relative_to(source)), p.stat().st_size, f"mtime-{p.stat().st_mtime_ns}")
        for p in source.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    )
    names = [name for name, _, _ in files]
    if not names:
        raise UserError(f"{source} holds no file to stage; pass the folder of the model (its config.json).")
    last = "config.json" if "config.json" in names else max(files, key=lambda f: f[1])[0]
    return stage(source, Path(stage_dir).expanduser(), [f for f in files if f[0] != last], last, verify=False)
