"""A frozen copy of the project's code for each submitted job, so every attempt runs what was submitted.

slurmctld keeps its own copy of the batch script, but a script that `cd`s to the project runs whatever
src/ and conf/ hold when an attempt starts: a user who goes on editing after submitting (the normal
case) would get a requeued attempt running other code, and exact resume would silently not hold. So
scripts/submit.py copies the code at submission and submits the copy's batch script from inside it:

- what is copied: the files git tracks (as they are in the working copy, uncommitted changes included),
  the untracked files git does not ignore (a new model file), and the git-ignored `conf/local/`; never a
  file that holds secrets by its name (`.env`, `.env.*`, `.netrc`, keys: `SECRET_FILES`), tracked or not:
  a snapshot is shared by every job submitted with the same code and kept under logs/;
- where: `<project>/logs/snapshots/<digest>/`, content-addressed (the digest is over every file's path
  and contents), so jobs submitted with the same code share one copy; a copy is written to a temporary
  folder and renamed, so a half-written one is never used;
- `SNAPSHOT.yaml` in it: the commit, whether the working copy differed from it, the diff's sha256, the
  project it came from. run.yaml records it (`git:`) for every run started from the copy.

The job runs from the copy (sbatch --chdir) with HPCTRAIN_PROJECT_ROOT naming the project, whose logs/,
data/ and .venv stay where they are (`paths.root_dir` is the project, see `launched.project_root`).
No torch import.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

MANIFEST = "SNAPSHOT.yaml"
STORE = Path("logs") / "snapshots"
ALSO_IGNORED = ("conf/local",)  # git-ignored, yet part of what a run composes
SECRET_FILES = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    ".netrc",
    ".git-credentials",
    ".pypirc",
    "*.pem",
    "*.key",
    "id_rsa*",
    "id_ecdsa*",
    "id_ed25519*",
)


def holds_secrets(name: str) -> bool:
    """Whether a file's name says it holds secrets (`SECRET_FILES`): such a file is never copied."""
    return any(fnmatch.fnmatch(Path(name).name, pattern) for pattern in SECRET_FILES)


@dataclass(frozen=True)
class Snapshot:
    path: Path
    digest: str
    commit: str | None
    diff_sha256: str | None


def _git(project: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(project), *args], capture_output=True, check=False)


def code_files(project: Path) -> list[str]:
    """The project's code, as paths relative to it (see the module docstring)."""
    listed = _git(project, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed.returncode != 0:
        raise RuntimeError(
            f"{project} is not a git working copy ({listed.stderr.decode().strip()}); the code snapshot needs git "
            "to know which files are code: run `git init && git add -A`, or submit with --no-snapshot."
        )
    names = {name for name in listed.stdout.decode().split("\0") if name and (project / name).is_file()}
    for folder in ALSO_IGNORED:
        base = project / folder
        if base.is_dir():
            names.update(str(p.relative_to(project)) for p in base.rglob("*") if p.is_file())
    return sorted(name for name in names if not holds_secrets(name))


def take(project: str | Path, store: str | Path | None = None) -> Snapshot:
    """The snapshot of `project`'s code now: an existing one with the same contents, or a new one."""
    project = Path(project).resolve()
    store = project / STORE if store is None else Path(store)
    names = code_files(project)
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((project / name).read_bytes()).digest())
    key = digest.hexdigest()[:16]
    target = store / key
    commit = _git(project, "rev-parse", "HEAD").stdout.decode().strip() or None
    diff = _git(project, "diff", "HEAD").stdout if commit else b""
    diff_sha = hashlib.sha256(diff).hexdigest() if diff else None
    if not (target / MANIFEST).is_file():
        tmp = store / f".{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for name in names:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / name, tmp / name)
        manifest = {
            "commit": commit,
            "dirty": bool(diff) or bool(_git(project, "ls-files", "--others", "--exclude-standard").stdout),
            "diff_sha256": diff_sha,
            "source": str(project),
            "files": len(names),
            "taken": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (tmp / MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
        try:
            tmp.rename(target)
        except OSError:  # another submission wrote the same snapshot meanwhile: use that one
            shutil.rmtree(tmp, ignore_errors=True)
    return Snapshot(target, key, commit, diff_sha)


def manifest(code_root: str | Path) -> dict | None:
    """SNAPSHOT.yaml of the code this process runs, if it runs from a snapshot."""
    path = Path(code_root) / MANIFEST
    return yaml.safe_load(path.read_text()) if path.is_file() else None
