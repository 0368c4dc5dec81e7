"""Whether a project's copy of hpctrain is the one it recorded: a project carries hpctrain untouched, so that
`copier update` brings hpctrain's next version with no merge. The template's copier task records the sha256
of every hpctrain file in src/hpctrain/files.sha256 when it copies or updates the project; this module
compares them (a project's tests run it; `python -m hpctrain.testing.untouched` does it alone).

Standard library only, and importable by file path: the copier task writes the record with it, in
copier's own interpreter, before the project has any environment.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

RECORD = Path("hpctrain") / "files.sha256"  # under src/
CARRIED = ("hpctrain", "hydra_plugins/hpctrain_conf", "hydra_plugins/hpctrain_sweeps")
NOT_CARRIED = ("__pycache__", ".egg-info")


def carried_files(src: Path) -> list[Path]:
    """hpctrain's files under `src`, relative to it, without the record itself and Python's caches."""
    found = []
    for top in CARRIED:
        for path in (src / top).rglob("*"):
            relative = path.relative_to(src)
            cache = path.suffix == ".pyc" or any(n in part for part in relative.parts for n in NOT_CARRIED)
            if path.is_file() and relative != RECORD and not cache:
                found.append(relative)
    return sorted(found)


def digests(src: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256((src / p).read_bytes()).hexdigest() for p in carried_files(src)}


def write_record(src: Path, version: str, source: str) -> None:
    """Record hpctrain as it is in `src` now (the template's copy, at copy or update time)."""
    lines = [f"# hpctrain {version} from {source}: the files this project carries untouched"]
    lines += [f"{digest}  {name}" for name, digest in digests(src).items()]
    (src / RECORD).write_text("\n".join(lines) + "\n")


def read_record(src: Path) -> tuple[str, dict[str, str]] | None:
    path = src / RECORD
    if not path.is_file():
        return None  # the template itself: its hpctrain is the source, not a copy
    header, *rows = path.read_text().splitlines()
    recorded = dict(reversed(row.split("  ", 1)) for row in rows if row.strip())
    return header.removeprefix("# ").split(":")[0], recorded


def differences(src: Path) -> tuple[str, list[str]] | None:
    """hpctrain's version as recorded and the files that differ from the record (edited, added or
    removed); None where nothing is recorded."""
    record = read_record(src)
    if record is None:
        return None
    version, recorded = record
    now = digests(src)
    changed = sorted(name for name in set(now) | set(recorded) if now.get(name) != recorded.get(name))
    return version, [f"src/{name}" for name in changed]


def check(src: Path) -> str | None:
    """One sentence naming the hpctrain files that differ from the record, with what to do instead."""
    found = differences(src)
    if found is None or not found[1]:
        return None
    version, changed = found
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return (
        f"{shown} differ{'s' if len(changed) == 1 else ''} from {version} as this project recorded it "
        f"(src/{RECORD}): hpctrain is carried untouched so that copier update brings its next version "
        "without a merge; undo the edit (git checkout -- src/hpctrain) and instead subclass the class in your "
        "package, put a config of the same group and name in conf/, or propose the change to the template."
    )


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else Path("src")
    sentence = check(src)
    if sentence:
        print(f"error: {sentence}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
