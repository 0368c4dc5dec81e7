"""Where every rank is, on demand: Python's faulthandler on `diagnostics.stacks_signal`.

Each rank registers faulthandler (all threads) for the signal when it starts building its run, writing
to `<run dir>/stacks/rank<N>.txt` (appending), and notes `<rank> <pid> <host>` in a file of its own,
`<run dir>/stacks/rank<N>.pid` (appends of many nodes to one file on NFS are not atomic: lines interleave).
faulthandler's handler runs in C, so it answers even while the main thread is blocked inside a
collective. The default signal, SIGURG, is ignored by any process that has not registered it (a
loader worker, the batch shell), and forked loader workers drop the registration, so a signal sent to a
whole SLURM job reaches the ranks only. `python scripts/stacks.py <run dir | job id>` sends it and
sums the answers up (`summary`); the watchdog dumps every rank's stacks itself before a job it ends
because a rank did not arrive at a collective (`dump`).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hpctrain.runtime import confined, run_state
from hpctrain.runtime.environment import launched
from hpctrain.runtime.errors import UserError

STACKS_DIR = "stacks"
PIDS_FILE = "pids"  # 0.4 and before: every rank appended its line here (still read)
PID_SUFFIX = ".pid"  # rank<N>.pid: one rank's line, written whole by that rank alone
HEADER = "===== stacks"  # each dump begins with a line starting so, with its time and why


@dataclass
class Registered:
    """One run's faulthandler registration (`hpctrain.runtime.run_state`): the run's end unregisters it and
    closes its file, so a next job in this process neither dumps into this run's folder nor names it."""

    file: IO[str] | None = None  # <run dir>/stacks/rank<N>.txt, open while registered
    signal: int | None = None  # the signal faulthandler dumps the stacks on

    def close(self) -> None:
        file, signum = self.file, self.signal
        self.file, self.signal = None, None
        if signum is not None:
            faulthandler.unregister(signum)
        if file is not None:
            file.close()


def _registered() -> Registered:
    return run_state.part(Registered)


def _forget() -> None:
    """In a forked child (a loader worker): the signal goes back to its default (ignored)."""
    registered = run_state.current().peek(Registered)
    if registered is not None and registered.signal is not None:
        faulthandler.unregister(registered.signal)
        registered.file, registered.signal = None, None


# once per process, not per run: a fork hook cannot be unregistered, and this one reads the current run
os.register_at_fork(after_in_child=_forget)


def rank_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / STACKS_DIR / f"rank{rank}.txt"


def register(run_dir: str | Path, signal_name: str) -> None:
    """Dump this process's stacks to its rank's file on `signal_name` (see the module docstring)."""
    signum = signal.Signals[signal_name]
    rank = launched.global_rank()
    folder = Path(run_dir) / STACKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    registered = _registered()
    registered.close()  # an earlier registration of this run (a second build)
    file = open(rank_file(run_dir, rank), "a", buffering=1)  # noqa: SIM115 - open until the run ends (Registered.close)
    pid_file = folder / f"rank{rank}{PID_SUFFIX}"
    partial = pid_file.with_name(f".{pid_file.name}.partial")
    partial.write_text(f"{rank} {os.getpid()} {socket.gethostname()}\n")
    os.replace(partial, pid_file)  # whole: a reader never sees half a line, a restart replaces it
    faulthandler.register(signum, file=file, all_threads=True, chain=False)
    registered.file, registered.signal = file, signum


def run_dir() -> Path | None:
    """The run dir whose stacks folder this process writes to (None before `register`)."""
    file = _registered().file
    return Path(file.name).parents[1] if file is not None else None


def dump(reason: str) -> None:
    """Append this process's stacks to its rank's file now (from any thread), under a header saying why."""
    file: IO[str] | None = _registered().file
    if file is None:
        return
    file.write(f"\n{HEADER} {time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}\n")
    file.flush()
    faulthandler.dump_traceback(file=file, all_threads=True)


# --------------------------------------------------------------------------------- reading the dumps

_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_LIBRARY = ("site-packages", "dist-packages")


def _library(path: str) -> bool:
    """torch, Lightning and the rest of the installed packages, or Python's standard library."""
    if any(f"{os.sep}{part}{os.sep}" in path for part in _LIBRARY):
        return True
    stdlib = os.path.dirname(os.__file__)
    return path.startswith(stdlib) or path.startswith("<")


def main_thread_frames(dump_text: str) -> list[tuple[str, int, str]]:
    """The frames (path, line, function; innermost first, as faulthandler writes them) of the thread
    that runs the program: the one whose outermost frame is a module's top level."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump_text.splitlines():
        if _THREAD.match(line):
            threads.append([])
            continue
        found = _FRAME.match(line)
        if found and threads:
            threads[-1].append((found["path"], int(found["line"]), found["function"]))
    main = [t for t in threads if t and t[-1][2] == "<module>"]
    return main[0] if main else (threads[0] if threads else [])


_RUNTIME = str(Path(__file__).resolve().parents[1])  # the template's machinery
_ENTRY_POINTS = str(Path(__file__).resolve().parents[3])  # src/: train.py, eval.py, ...


def _machinery(path: str) -> bool:
    return path.startswith(_RUNTIME) or os.path.dirname(path) == _ENTRY_POINTS


def where(frames: list[tuple[str, int, str]]) -> str:
    """`all_reduce in training_step at model.py:41`: the innermost call, and the innermost frame of the
    user's code (outside torch, Lightning, the standard library and the template's machinery); with no
    such frame, the innermost frame of the library that called the innermost one, marked so."""
    if not frames:
        return "no Python frames"
    innermost = frames[0][2]
    own = next((f for f in frames if not _library(f[0]) and not _machinery(f[0])), None)
    caller = own or next((f for f in frames[1:] if "lightning" in f[0]), frames[0])
    path, line, function = caller
    site = f"{function} at {os.path.basename(path)}:{line}" + ("" if own else " (library code)")
    return site if caller is frames[0] else f"{innermost} in {site}"


def latest_dump(path: Path, since: int = 0) -> str:
    """The text of the newest dump in a rank's file, written after byte `since`."""
    if not path.is_file():
        return ""
    with open(path, errors="replace") as file:
        file.seek(since)
        text = file.read()
    return text[text.rfind(HEADER) :] if HEADER in text else text


def places(run_dir: Path) -> dict[int, str]:
    """Where each of the run's ranks stood in its newest dump (`where`); a rank without one is left out."""
    found = {}
    for rank in sorted(known_ranks(run_dir)):
        frames = main_thread_frames(latest_dump(rank_file(run_dir, rank)))
        if frames:
            found[rank] = where(frames)
    return found


def folder_note(run_dir: Path | None) -> str:
    """What a sentence about a hang ends with: where every rank's stacks are (nothing without a folder)."""
    return f"; every rank's stacks: {run_dir / STACKS_DIR}/rank<N>.txt" if run_dir is not None else ""


def ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 4, 5] -> 'ranks 0-2, 4-5'; [3] -> 'rank 3'."""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return f"{'ranks' if len(ordered) > 1 else 'rank'} {', '.join(parts)}"


def summary(places: dict[int, str]) -> str:
    """Ranks grouped by where they are, the largest group first: 'ranks 0-2: ...; rank 3: ...'."""
    groups: dict[str, list[int]] = {}
    for rank, place in places.items():
        groups.setdefault(place, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), min(item[1])))
    return "; ".join(f"{ranges(ranks)}: {place}" for place, ranks in ordered)


def known_ranks(run_dir: str | Path) -> dict[int, tuple[int, str]]:
    """rank -> (pid, host) of the run's latest processes, from `stacks/rank<N>.pid` (and the one
    `stacks/pids` file of a run started by hpctrain 0.4 or before)."""
    found: dict[int, tuple[int, str]] = {}
    folder = Path(run_dir) / STACKS_DIR
    files = [folder / PIDS_FILE, *sorted(folder.glob(f"rank*{PID_SUFFIX}"))]
    for path in files:
        try:
            text = confined.read_text(path, "record", folder=run_dir)
        except (OSError, UserError):  # missing, or not a record a run writes: no process of it
            continue
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
                found[int(parts[0])] = (int(parts[1]), parts[2])
    return found
