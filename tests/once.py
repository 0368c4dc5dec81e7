"""What many tests read and one run makes (a trained checkpoint, a run folder), made once per session.

pytest-xdist's workers are separate processes, so a session fixture alone would make it once per worker.
`made_once` makes it once for all of them: the first worker to ask makes it in the session's base temp
dir, under a file lock; the others wait for the lock and read what it made."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

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
