"""A training process killed at each step of a checkpoint save (tests/test_commit_kills.py).

Added to a real `python src/train.py` run as a callback:

    +callbacks.kill_points._target_=tests.kill_saves.KillPoints +callbacks.kill_points.out=<dir>
    +callbacks.kill_points.folder='${paths.output_dir}/checkpoints'

It acts as the run builds its callbacks, before the trainer exists (no process group, no autograd
thread yet: neither survives a fork): it forks a child for k = 1, 2, ..., and the child builds the
trainer and trains. Each child journals every commit into the checkpoint folder (a rename or replace
onto a checkpoint's own name, with the global step the committed checkpoint holds) and SIGKILLs itself,
in whichever thread gets there (the asynchronous writers too), just before its k-th change to that
folder: a file or folder created or opened for writing, a rename, a replace, a removal (of a
checkpoint: removing a temporary name is cleanup, no step of a commit). The parent waits, keeps a copy of the folder as the kill left it
(`<out>/kill-<k>/checkpoints`, with the journal up to the kill in `journal.json` and the change it was
killed before in `killed-before.txt`), and empties the folder again. The first child that completes
without meeting its k-th change ends the loop (`<out>/kill-points.json`), and the parent exits.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from pytorch_lightning import Callback

from hpctrain.runtime.storage.checkpoints import reading

_real = {
    "rename": os.rename,
    "replace": os.replace,
    "unlink": os.unlink,
    "remove": os.remove,
    "mkdir": os.mkdir,
    "rmtree": shutil.rmtree,
    "open": io.open,
}
MAX_KILLS = 60


class KillPoints(Callback):
    def __init__(self, out: str, folder: str) -> None:
        self.out, self.folder = Path(out), Path(folder).resolve()
        self.journal: list[list[Any]] = []  # [name, global step] of each commit, in order
        self.kill_at = 0
        self.changes: list[str] = []  # this child's changes so far
        self.folder.mkdir(parents=True, exist_ok=True)
        import sklearn.datasets  # noqa: F401  (what every child's datamodule imports: once, here)

        crashes: list[str] = []
        k = 1
        while k <= MAX_KILLS:
            pid = os.fork()
            if pid == 0:
                self.kill_at = k
                self._patch()
                return  # the child builds the trainer, trains, and dies at its k-th change
            _, status = os.waitpid(pid, 0)
            kill = self.out / f"kill-{k}"
            if not os.WIFSIGNALED(status):  # completed: every change of the run has been a kill point
                summary = {
                    "kills": k - 1,
                    "exit_status": os.waitstatus_to_exitcode(status),
                    "crashes": crashes,
                }
                self._write(self.out / "kill-points.json", summary)
                _real["rmtree"](kill, ignore_errors=True)
                os._exit(0)
            if (kill / "killed-before.txt").is_file():
                shutil.copytree(self.folder, kill / "checkpoints", symlinks=True)
                k += 1
            else:  # died of something else than its kill: said in the summary, and tried again
                # A fork of a process with threads (the watchdog's, a save's, OpenMP's) may inherit a
                # lock another thread held: under load a child can die at random. Only a kill point
                # whose child dies again and again fails the test.
                crashes.append(f"kill point {k}: {signal.Signals(os.WTERMSIG(status)).name}")
                _real["rmtree"](kill, ignore_errors=True)
                if sum(c.startswith(f"kill point {k}:") for c in crashes) > 5:
                    raise AssertionError(f"the children keep dying before kill point {k}: {crashes}")
            _real["rmtree"](self.folder)
            self.folder.mkdir()
        raise AssertionError(f"more than {MAX_KILLS} changes to the checkpoint folder")

    # ------------------------------------------------------------------- the folder's changes

    def _inside(self, path: Any) -> bool:
        return isinstance(path, str | os.PathLike) and Path(path).resolve().parent == self.folder

    def _change(self, what: str, path: Any) -> None:
        """Before a change of the checkpoint folder: the k-th is where this child dies. Removing a
        temporary name (a write's leftover, or nothing) is no step of a commit, nor is creating what exists."""
        if not self._inside(path):
            return
        name = Path(path).name
        if (what in ("unlink", "remove", "rmtree") and ".tmp-" in name) or (
            what == "mkdir" and Path(path).exists()
        ):
            return
        self.changes.append(f"{what} {Path(path).name}")
        if len(self.changes) == self.kill_at:
            self._write(self.out / f"kill-{self.kill_at}" / "killed-before.txt", self.changes[-1])
            os.kill(os.getpid(), signal.SIGKILL)

    def _committed(self, destination: Any) -> None:
        path = Path(destination)
        if self._inside(path) and not path.name.startswith("."):
            self.journal.append([path.name, reading.read(path, weights=False).get("global_step")])
            self._write(self.out / f"kill-{self.kill_at}" / "journal.json", self.journal)

    def _patch(self) -> None:
        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self._change("rename", dst if self._inside(dst) else src)
            _real["rename"](src, dst, *args, **kwargs)
            self._committed(dst)

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self._change("replace", dst)
            _real["replace"](src, dst, *args, **kwargs)
            self._committed(dst)

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            self._change("unlink", path)
            _real["unlink"](path, *args, **kwargs)

        def remove(path: Any, *args: Any, **kwargs: Any) -> None:
            self._change("remove", path)
            _real["remove"](path, *args, **kwargs)

        def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
            self._change("mkdir", path)
            _real["mkdir"](path, *args, **kwargs)

        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            self._change("rmtree", path)
            _real["rmtree"](path, *args, **kwargs)

        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if any(c in mode for c in "wax+") and isinstance(file, str | os.PathLike):
                self._change("write", file)
            return _real["open"](file, mode, *args, **kwargs)

        os.rename, os.replace, os.unlink, os.remove, os.mkdir = rename, replace, unlink, remove, mkdir
        shutil.rmtree = rmtree
        builtins.open = io.open = open_  # pathlib opens with io.open
        self._write(self.out / f"kill-{self.kill_at}" / "journal.json", self.journal)

    @staticmethod
    def _write(path: Path, value: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)  # outside the checkpoint folder: never a kill point
        with _real["open"](path, "w") as file:
            json.dump(value, file)
