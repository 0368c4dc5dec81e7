"""A path that comes from a received file stays inside the folder it belongs to.

A run dir, a checkpoint folder, a sweep dir may come from someone else: every path read from one (a
shard its index names, a checkpoint a callback's state names, a run's process ids and stack files) is
resolved, symlinks followed and `..` removed, and must lie inside its folder (`inside`), else it is
refused or dropped with one warning. A folder that hpctrain writes into holds no link that leads out of
it (`check_no_links_out`): a received `metrics.csv` or `stacks/rank0.txt` that is a link to a file of
the user's would otherwise be appended to. Nothing is written, moved or deleted outside the run dir on
the strength of what a received file says. No torch here; standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpctrain.runtime.errors import UserError


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
