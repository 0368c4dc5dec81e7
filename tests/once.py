"""What many tests read and one run makes (a trained checkpoint, a run folder), made once per session.

pytest-xdist's workers are separate processes, so a session fixture alone would make it once per worker.
`made_once` makes it once for all of them: the first worker to ask makes it in the session's base temp
dir, under a file lock; the others wait for the lock and read what it made. `kept` keeps what collection
derives from the code and configs (a parametrization) across sessions, until they change."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `<base temp>/<name>`, filled by `make(folder)` once in this session, whichever worker
    asks first. A `make` that fails leaves no folder behind, so the next test to ask tries again and
    fails with its own output. The tests that read it must not write into it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # every worker's base temp dir is in the session's
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a worker that dies
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


def kept(name: str, sources: Iterable[Path], make: Callable[[], Any], extra: str = "") -> Any:
    """`make()` (JSON data), kept in .pytest_cache under a digest of the files `sources` and `extra`: each
    worker's collection reads it instead of making it again (compositions cost 0.1 s each), until one
    of those changes. Workers that make it at once write the same file."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources))
    digest.update(extra.encode())
    path = Path(__file__).resolve().parents[1] / ".pytest_cache" / f"{name}-{digest.hexdigest()[:16]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    found = make()
    path.parent.mkdir(exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(found))
    os.replace(partial, path)
    return found
