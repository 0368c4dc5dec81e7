"""When one rank dies, the whole job ends within seconds, naming that rank.

DDP ranks wait for each other in every collective. A rank that raises, is OOM-killed or SIGKILLed
leaves the others waiting: gloo notices a closed connection at once, but names no rank, and NCCL
may wait out its whole collective timeout (30 minutes by default). Three mechanisms close that gap:

- A rank whose code raises prints its traceback and one line, `error: rank R on HOST failed: ...`,
  and records that line in the job's store before it exits (`failures_reported`, `failures`).
- Every rank runs a `Watchdog` thread once its process group exists: every second it publishes where
  this rank is (`positions`) and looks for a recorded failure (one small request to the store); when it
  finds one, it prints who failed and exits. If the store itself stops answering (rank 0's process is
  gone), it exits too, saying so. It also ends the job when another rank's training data ran out
  before this one's, and dumps this rank's stacks when asked (`stacks`).
- When no batch has completed for most of the collective timeout (`Stall`: 80 %, or the timeout less a
  minute), the job is hung: the watchdog names the rank it waits for, with every rank's stacks, and ends
  it before the timeout, where NCCL's own watchdog would tear the processes down with no sentence.
- Under the template's own local launcher, rank 0 also watches the processes it started (a child
  killed by SIGKILL or the OOM killer never records anything), and each child dies with its parent.

Under SLURM, srun's `--kill-on-bad-exit=1` (slurm/train.sbatch) ends every task as soon as one exits
badly and names the task; under torchrun, its agent does the same. The watchdog adds the sentence
and covers the local launcher, where nothing else would.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hpctrain.runtime import run_state
from hpctrain.runtime.distributed import failures, flight_recorder, positions, signals, stacks
from hpctrain.runtime.distributed.failures import STORE_LOST, announce, dead_child, exit_with
from hpctrain.runtime.distributed.job_store import DUMP_KEY, FAILED_KEY, rank, store

POLL_S = 1.0
LOST_AFTER = 3  # consecutive failed polls of the store before concluding rank 0's process is gone


class Watchdog(threading.Thread):
    def __init__(self, rank: int) -> None:
        super().__init__(name="rank-watchdog", daemon=True)
        self.rank = rank
        self._stopped = threading.Event()
        self._stall = Stall()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        job = store()
        misses = 0
        dumped = False
        while not self._stopped.wait(POLL_S):
            dead = dead_child()
            if dead and not failures.state().stopping:
                announce(job, f"{dead}")
                exit_with(f"error: {dead} on {socket.gethostname()}; ending the job.")
            if job is None:
                continue
            try:
                positions.publish(job, self.rank)
                if not dumped and job.check([DUMP_KEY]):  # before the failure below ends this process
                    stacks.dump(job.get(DUMP_KEY).decode(errors="replace"))
                    flight_recorder.dump()
                    dumped = True
                failed = job.check([FAILED_KEY]) and job.get(FAILED_KEY).decode(errors="replace")
                misses = 0
            except Exception:
                misses += 1
                if misses >= LOST_AFTER and not self._stopped.is_set() and not failures.state().stopping:
                    exit_with(f"error: {STORE_LOST}; ending rank {self.rank} on {socket.gethostname()} too.")
                continue
            if failed and not self._stopped.is_set():
                exit_with(f"error: {failed}; rank {self.rank} stops too.")
            stalled = self._stall.seconds()
            if stalled is not None and not self._stopped.is_set() and not failures.state().stopping:
                failures.declare_hang(stalled)
            uneven = positions.ran_past_another_ranks_data(job, self.rank)
            if uneven and not self._stopped.is_set() and not failures.state().stopping:
                announce(job, uneven)
                exit_with(f"error: {uneven}.")


HANG_SHARE = 0.8  # a job whose batches stopped for this share of the collective timeout is declared hung
HANG_MARGIN_S = 60.0  # ... or for the timeout less this, whichever is later: ahead of NCCL's own watchdog


class Stall:
    """How long this rank has gone without completing a batch (train, validation, test or predict) while a
    run is in those loops, once that is most of the collective timeout (`seconds`); else None."""

    def __init__(self) -> None:
        self._seen = -1
        self._since = time.monotonic()

    def seconds(self) -> float | None:
        progress, armed = signals.progress()
        now = time.monotonic()
        if progress != self._seen or not armed:
            self._seen, self._since = progress, now
            return None
        timeout = failures.state().timeout_min
        if not timeout:
            return None
        # declared (and the dumps gathered, 3 s) before the timeout itself, whatever it is
        limit = min(max(HANG_SHARE * timeout * 60, timeout * 60 - HANG_MARGIN_S), timeout * 60 - 5)
        stalled = now - self._since
        return stalled if stalled >= limit else None


@dataclass
class Watching:
    """One run's watchdog (`hpctrain.runtime.run_state`): the run's end stops its thread."""

    thread: Watchdog | None = None  # the running Watchdog
    finished_worker: bool = False  # a rank > 0 whose run completed (exit_if_finished_worker)

    def close(self) -> None:
        if self.thread is not None:
            stop()


def _watching() -> Watching:
    return run_state.part(Watching)


def start() -> None:
    """Start watching (once the process group exists; a no-op for a single process)."""
    watching = _watching()
    if watching.thread is not None or store() is None:
        return
    failures.state().stopping = False
    watching.thread = Watchdog(rank())
    watching.thread.start()


def stop() -> None:
    """The job is ending normally (or requeueing): stop watching, so an orderly exit is not a failure."""
    failures.state().stopping = True
    watching = _watching()
    thread = watching.thread
    if thread is not None:
        thread.stop()
        # Wait for it to leave its store request: a thread still inside the store's C++ code when the
        # process group is destroyed, or when the interpreter exits, can abort the process.
        if thread is not threading.current_thread():
            thread.join(timeout=POLL_S + 5)
        watching.thread = None


@contextmanager
def failures_reported() -> Iterator[None]:
    """Around a rank's whole run: an unexpected exception is printed with a line naming the rank that
    failed first (this one, or another whose failure made this one's collective break), recorded for
    the other ranks, and ends the process with status 1 without waiting for anything."""
    try:
        yield
    except BaseException as err:
        if failures.expected(err):
            stop()
            raise
        failures.note_failure(err)
        if not failures.state().explained:
            traceback.print_exc()
        failures.state().explained = False
        exit_with(f"error: {failures.take_verdict()}")


def finished_worker() -> None:
    """Called on a rank other than 0 once its run completed and the final barrier passed."""
    _watching().finished_worker = True


def exit_if_finished_worker() -> None:
    """A rank other than 0 whose run completed leaves with os._exit(0), after flushing its output.

    It has nothing left to write (rank 0 writes every file, and the final barrier has passed), and a
    normal interpreter exit runs C++ destructors that, rarely and only under load, abort a process
    after its process group was destroyed ("terminate called without an active exception"): srun or
    torchrun would then fail a job that trained fine.
    """
    if _watching().finished_worker:  # the ended run's: read after the job, as main() returns
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
