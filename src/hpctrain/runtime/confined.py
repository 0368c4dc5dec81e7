"""A received folder is data: what hpctrain reads of it is bounded, and stays inside it.

A run dir, a checkpoint folder, a sweep dir, a shard set may come from someone else:
- every file hpctrain reads of one goes through `read_bytes` (and `read_text`, `read_yaml`, `read_json`):
  a regular file only (a device, a pipe or a socket is refused, and a pipe never blocks the reader),
  inside its folder when one is given, at most a limit of bytes per kind (`LIMITS`), and YAML without
  anchors, aliases or tags (an alias can expand without end);
- every path read from one (a shard its index names, a checkpoint a callback's state names, a run's
  process ids and stack files) is resolved, symlinks followed and `..` removed, and must lie inside its
  folder (`inside`), else it is refused or dropped with one warning;
- a folder that hpctrain writes into holds no link that leads out of it (`check_no_links_out`): a received
  `metrics.csv` or `stacks/rank0.txt` that is a link to a file of the user's would otherwise be appended to.
Nothing is written, moved or deleted outside the run dir on the strength of what a received file says.
No torch here.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from hpctrain.runtime.errors import UserError

# the most a received file of each kind holds: a record (run.yaml, outcome.yaml, Hydra's), an index (a
# manifest, a shard list, a checkpoint's .metadata) and a table (metrics.csv) are small; checkpoints and
# shards themselves are read by torch and by offset, never whole
LIMITS = {"record": 16 << 20, "index": 256 << 20, "table": 1 << 30}


class UnreadableFile(UserError):
    pass


def read_bytes(
    path: str | os.PathLike[str], kind: str, folder: str | os.PathLike[str] | None = None
) -> bytes:
    """A received file's bytes: a regular file, inside `folder` when given, at most `LIMITS[kind]` bytes."""
    path = Path(path)
    if folder is not None and not inside(path, folder):
        raise UnreadableFile(
            f"{path} leads outside {folder}, where it belongs; pass a folder that holds its own files."
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a pipe opens without a writer
    except OSError as err:
        raise UnreadableFile(
            f"{path} cannot be read ({err.strerror}); pass a folder written by this template."
        ) from err
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise UnreadableFile(
                f"{path} is not a regular file (a device, a pipe or a socket), which no file of a folder hpctrain "
                "writes is; remove it, or pass a folder written by this template."
            )
        limit = LIMITS[kind]
        if found.st_size > limit:
            raise UnreadableFile(
                f"{path} holds {found.st_size} bytes, more than a {kind} file of this template ever does ({limit}); "
                "pass a folder written by this template."
            )
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read(limit + 1)[:limit]
    finally:
        os.close(fd)


def regular_file(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """`path`, a regular file inside `folder` (what is read of it later, by offset, is its own bytes)."""
    path = Path(path)
    try:
        regular = inside(path, folder) and stat.S_ISREG(path.stat().st_mode)
    except OSError:
        regular = False
    if not regular:
        raise UnreadableFile(
            f"{path} is not a regular file inside {folder} (a link out, a device, a pipe or a socket), which no file "
            "of a folder hpctrain writes is; pass a folder written by this template."
        )
    return path


def read_text(path: str | os.PathLike[str], kind: str, folder: str | os.PathLike[str] | None = None) -> str:
    return read_bytes(path, kind, folder).decode("utf-8", errors="replace")


def read_yaml(
    path: str | os.PathLike[str], kind: str = "record", folder: str | os.PathLike[str] | None = None
) -> Any:
    """A received YAML file's plain content: no anchor, alias or tag (hpctrain writes none), else one sentence."""
    text = read_text(path, kind, folder)
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        tagged = isinstance(event, yaml.NodeEvent) and (
            getattr(event, "tag", None) is not None and not any(getattr(event, "implicit", (True,)) or ())
        )
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) or tagged:
            raise UnreadableFile(
                f"{path} uses YAML anchors, aliases or tags, which no record hpctrain writes holds (an alias can "
                "expand without end); pass a folder written by this template."
            )
    return yaml.safe_load(text)


def read_json(
    path: str | os.PathLike[str], kind: str = "index", folder: str | os.PathLike[str] | None = None
) -> Any:
    return json.loads(read_text(path, kind, folder))


class LinkOutside(UserError):
    pass


# Links a logger library makes itself, which neither it nor hpctrain writes or reads through again: W&B
# links each run's `logs/debug-core.log` to its service's log in the user's cache (~/.cache/wandb/logs);
# a resumed run gets a new offline-run folder with a link of its own.
LOGGERS_OWN_LINKS = ("wandb/*/logs/debug-core.log",)


def inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether `path`, resolved (symlinks followed, `..` removed), lies inside `folder`, resolved."""
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the filesystem refuses
        return False


def links_out(folder: str | os.PathLike[str]) -> list[tuple[Path, Path]]:
    """(link, where it leads) for every symlink under `folder` (not followed) that leads outside it."""
    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in (*dirs, *files):
            path = Path(root) / name
            if (
                path.is_symlink()
                and not inside(path, folder)
                and not any(path.relative_to(folder).match(own) for own in LOGGERS_OWN_LINKS)
            ):
                found.append((path, Path(os.readlink(path))))
    return sorted(found)


def check_no_links_out(folder: str | os.PathLike[str], what: str = "the run dir") -> None:
    """Refuse, in one sentence and before anything is written, a folder that holds a link out of it."""
    if not Path(folder).is_dir():
        return
    found = links_out(folder)
    if found:
        link, target = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise LinkOutside(
            f"{what} {folder} holds {link.relative_to(folder)}, a link to {target} outside it{more}: a run writes "
            "and reads only its own files, so nothing was written; remove the link (or copy the folder without "
            "links: cp -rL), or start in a new run dir."
        )
