"""The template owns SIGTERM and the requeue signal for the whole life of the process; while a run goes
on, the handlers only record.

Python runs a signal handler between two bytecodes of whatever the main thread is doing, possibly in
the middle of a backward pass. A handler that saves a checkpoint or runs a collective there (as
Lightning's SLURM auto-requeue handler does, and its SIGTERM handler, which broadcasts) can meet
another rank sitting in a different collective: the job hangs. So `install` (called before any heavy
import, so a signal during startup is recorded too) replaces both handlers with ones that only
remember the strongest signal seen, and `take_over_from_lightning` stops Lightning from installing
its own and from broadcasting a SIGTERM flag at every training step. `hpctrain.runtime.distributed.requeue` acts on the
record at points where every rank takes the same collective path.

A signal that only records can go unanswered: a rank stuck in a collective, a hung callback, a loader
that never yields never reaches the next step boundary. So a `StopGuard` thread hears SIGTERM and
Ctrl-C (SIGINT) at once, even while the main thread is blocked in C (Python's wakeup file descriptor),
and while a run trains, tests or predicts: if no batch completes for `GRACE_S` seconds (longer when
batches are slow) and no step boundary has answered, it writes every rank's stacks, says in one sentence
where each rank stood, and ends every local rank with 128 + the signal (143, 130). A second signal ends
it at once. Outside those loops (startup, the final report) Ctrl-C is Python's KeyboardInterrupt.

After a run completed (`completed`), SIGTERM and SLURM's signals are noted and change nothing: the time
limit's warning can come late, while the process tears down, and by default it kills, so Slurm would
record a job that did all its work as FAILED (an `afterok` dependency would never start). For the
interpreter's own end (`ignored_until_exit`) they are ignored: CPython gives a signal with a Python
handler its default action back as it finalizes, while an ignored one stays ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.runtime import run_state
from hpctrain.runtime.distributed import flight_recorder, job_store, stacks
from hpctrain.runtime.environment import launched

NO_SIGNAL, TERMINATE, REQUEUE = 0, 1, 2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 10.0  # seconds without a completed batch, after a stop signal, before the run is ended anyway


@dataclass
class SignalRecord:
    """The signals of one run (`hpctrain.runtime.run_state`), and its stop guard. The handlers are the
    process's, so they record into whichever run is current; the run's end stops its guard (`close`)."""

    received: int = NO_SIGNAL  # the strongest signal recorded so far
    requeue_signal: signal.Signals | None = None  # the one that requeues (the SLURM time-limit warning)
    early: set[int] = field(default_factory=set)  # arrived during startup, before install()
    stop_signal: int | None = None  # the first SIGTERM or SIGINT recorded: the exit status is 128 + it
    guard: StopGuard | None = None  # the thread that ends a run no step boundary answers

    def hand_over(self, next_run: run_state.State) -> None:
        """A signal that arrived before `install` (during startup) is the next run's to act on."""
        early, self.early = self.early, set()
        next_run.part(SignalRecord).early |= early

    def close(self) -> None:
        """The run ends: its guard stops (the next run's `install` starts its own, with nothing of this
        run's progress, arming or local ranks)."""
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.close()


def _state() -> SignalRecord:
    return run_state.part(SignalRecord)


class Interrupted(Exception):
    """The run stopped on a recorded signal, at a point every rank agreed on (see
    hpctrain.runtime.distributed.requeue); `checkpoint` (if any) holds everything to continue from."""

    def __init__(self, code: int, checkpoint: Path | None, where: str) -> None:
        name = requeue_signal_name() if code == REQUEUE else "SIGTERM"
        super().__init__(f"{name} {where}" + (f": saved {checkpoint}" if checkpoint else ""))
        self.code = code
        self.checkpoint = checkpoint
        self.requeue = code == REQUEUE and launched.slurm_job_id() is not None


def _record(signum: int, frame: Any) -> None:
    state = _state()
    code = REQUEUE if signum == state.requeue_signal else TERMINATE
    if code == TERMINATE and state.stop_signal is None:
        state.stop_signal = signum
    state.received = max(state.received, code)


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: while a run trains, tests or predicts, a stop at the next step boundary (the guard ends it
    if none comes); otherwise Python's KeyboardInterrupt."""
    state = _state()
    guard = state.guard
    if guard is not None and guard.armed and state.requeue_signal is not None:
        _record(signum, frame)  # acted on at the next step boundary, as SIGTERM is (requeue.enabled)
        return
    signal.default_int_handler(signum, frame)


def exit_code() -> int:
    """The exit status of a run stopped on a signal: 130 after Ctrl-C, 143 after SIGTERM."""
    return 128 + (_state().stop_signal or signal.SIGTERM)


EARLY = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def install_early() -> None:
    """At the very start of an entry point, before the config says which signal requeues: record
    SIGTERM, SIGUSR1 and SIGUSR2, so a signal during startup is never lost (their default is to kill)."""
    for sig in EARLY:
        signal.signal(sig, _record_early)


def _record_early(signum: int, frame: Any) -> None:
    _state().early.add(signum)


def completed() -> None:
    """The job's work is done and recorded: from now on SIGTERM and SLURM's signals are noted, one line
    each, and the process goes on to exit 0 (a time limit's warning that comes during the teardown)."""
    if threading.current_thread() is threading.main_thread():
        for sig in EARLY:
            signal.signal(sig, _late)


def _late(signum: int, frame: Any) -> None:
    print(
        f"note: {signal.Signals(signum).name} arrived after the run completed; its work is saved, so the "
        "process ends normally.",
        file=sys.stderr,
        flush=True,
    )


def ignored_until_exit() -> None:
    """The process's last Python lines: SIGTERM and SLURM's signals ignored. As CPython finalizes it gives
    every signal that has a Python handler its default action back (which kills) but keeps ignored ones
    ignored, and destructors (torch's, loggers') can take seconds after that."""
    if threading.current_thread() is threading.main_thread():
        for sig in EARLY:
            signal.signal(sig, signal.SIG_IGN)


def install(requeue_signal: str | None, stop_grace_s: float | None = None) -> None:
    """From now on record SIGTERM and `requeue_signal` (the SLURM time-limit warning, e.g. SIGUSR1),
    counting what arrived during startup. With `requeue_signal=None` (requeue disabled) the default
    actions come back, and a signal that arrived during startup ends the process now."""
    state = _state()
    early, state.early = state.early, set()
    chosen = signal.Signals[requeue_signal] if requeue_signal else None
    state.requeue_signal = chosen
    state.received = NO_SIGNAL
    state.stop_signal = None
    for sig in EARLY:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt)
    if state.guard is None and threading.current_thread() is threading.main_thread():
        state.guard = StopGuard(state)
    if state.guard is not None:
        state.guard.grace_s = float(stop_grace_s or GRACE_S)
    if chosen is None:
        for signum in early:
            signal.raise_signal(signum)
        return
    signal.signal(signal.SIGTERM, _record)
    signal.signal(chosen, _record)
    for signum in early:
        if signum in (signal.SIGTERM, chosen):
            _record(signum, None)


def progressed(batch_s: float = 0.0) -> None:
    """A batch completed (train, validation, test or predict; `batch_s` its host time): the run moves."""
    guard = _state().guard
    if guard is not None:
        guard.progress += 1
        guard.batch_s = max(guard.batch_s * 0.9, batch_s)


def local_ranks(procs: list[Any]) -> None:
    """Rank 0 of the local launcher: the processes it started, which a forced end ends too."""
    guard = _state().guard
    if guard is not None:
        guard.children = list(procs)


def progress() -> tuple[int, bool]:
    """(batches completed so far, whether the run is in its train, test or predict loops) for the watchdog."""
    guard = _state().guard
    return (guard.progress, guard.armed) if guard is not None else (0, False)


def arm(armed: bool = True) -> None:
    """While a run trains, tests or predicts (the template's RankWatchdog sets it): a stop signal that no
    batch follows for the grace period ends the run (`StopGuard`)."""
    guard = _state().guard
    if guard is not None:
        guard.armed = armed


def answered() -> None:
    """The run acts on a recorded signal (a step boundary saves and stops): the guard lets it finish."""
    guard = _state().guard
    if guard is not None:
        guard.answered = True


class StopGuard(threading.Thread):
    """See the module docstring. Started by `install` from the main thread (which alone may set the
    wakeup file descriptor); Python's C-level handler writes each signal's number to it at once."""

    def __init__(self, record: SignalRecord) -> None:
        super().__init__(name="stop-guard", daemon=True)
        self.record = record  # the run's signals it guards
        self.closed = False
        self.armed = False
        self.answered = False
        self.progress = 0  # batches completed so far
        self.batch_s = 0.0  # about the longest recent batch, in seconds
        self.grace_s = GRACE_S
        self.children: list[Any] = []  # the local launcher's processes of ranks 1..N-1 (`local_ranks`)
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer  # open until the run ends (`close`)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self.start()

    def close(self) -> None:
        """The run ends (from the main thread, which alone may unset the wakeup file descriptor): the
        guard stops, and the wakeup descriptor with it, so the next run's guard starts from nothing."""
        if threading.current_thread() is not threading.main_thread():
            self.armed = False  # cannot unset the wakeup fd here: at least it ends nothing any more
            return
        # unset before the socket closes: Python's C handler must never write to a closed (reused) fd
        signal.set_wakeup_fd(-1)
        self.closed = True
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")  # wakes the thread from recv; 0 is no signal's number
        self.join(timeout=2.0)
        for end in (self._writer, self._reader):
            with contextlib.suppress(OSError):
                end.close()

    def run(self) -> None:
        stops = 0
        since: float | None = None  # when the run was last seen moving, after a stop signal
        seen = self.progress
        first = signal.SIGTERM
        while True:
            self._reader.settimeout(0.5 if since is not None else None)
            try:
                data = self._reader.recv(64)
            except TimeoutError:
                data = b""
            except OSError:
                return
            if self.closed:
                return
            for signum in data:
                if signum not in STOP_SIGNALS or (
                    signum == signal.SIGTERM and self.record.requeue_signal is None
                ):
                    continue  # the requeue signal; or SIGTERM without handler: its default ends the process
                stops += 1
                if stops == 1:
                    first, since, seen, self.answered = signum, time.monotonic(), self.progress, False
                else:
                    self._end(signum, f"a second {signal.Signals(signum).name}", at_once=True)
            if since is None or self.answered or not self.armed:
                if since is not None and not self.armed:
                    since = time.monotonic()  # outside the loops: the signal is acted on when they start
                continue
            if self.progress != seen:
                seen, since = self.progress, time.monotonic()
            grace = max(self.grace_s, 3 * self.batch_s)
            if time.monotonic() - since >= grace:
                self._end(first, f"{signal.Signals(first).name} was not answered within {grace:.0f} s")

    def _end(self, signum: int, reason: str, at_once: bool = False) -> None:
        """Every rank's stacks written, one sentence on rank 0, every local rank ended: 128 + `signum`."""
        code = 128 + signum
        me = job_store.rank()
        stacks.dump(reason)
        flight_recorder.dump()
        places = ""
        if not at_once:
            job = job_store.store()
            if job is not None:
                # every watchdog dumps within 1 s
                _bounded(lambda: job.compare_set(job_store.DUMP_KEY, "", reason))
                time.sleep(1.5)
            places = _where_ranks_stood()
        if me == 0:
            line = (
                f"error: {reason}: ending every local rank at once (exit {code})."
                if at_once
                else f"error: {reason}, and no step boundary came{places}; ending every local rank (exit {code})."
            )
            print(line, file=sys.stderr, flush=True)
        for child in self.children:  # the local launcher's ranks: ended before they outlive this one
            with contextlib.suppress(OSError):
                child.kill()
        sys.stdout.flush()
        logging.shutdown()
        os._exit(code)


def _bounded(call: Any, timeout_s: float = 2.0) -> None:
    """A store request that cannot hang the guard (the store's host may be the stuck process's peer)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)


def _where_ranks_stood() -> str:
    """` (rank 0: all_reduce in on_validation_end at my_callback.py:12; rank 1: ...); every rank's stacks:
    <dir>/rank<N>.txt`, from the dumps just written (empty without a stacks folder)."""
    run_dir = stacks.run_dir()
    if run_dir is None:
        return ""
    places = stacks.places(run_dir)
    shown = f" ({'; '.join(f'rank {rank}: {place}' for rank, place in places.items())})" if places else ""
    return f"{shown}{stacks.folder_note(run_dir)}"


def received() -> int:
    """The strongest signal recorded in this process (NO_SIGNAL, TERMINATE or REQUEUE)."""
    return _state().received


def requeue_signal_name() -> str:
    sig = _state().requeue_signal
    return sig.name if sig is not None else "SIGUSR1"


def take_over_from_lightning(trainer: Any) -> None:
    """Keep Lightning's own signal handling out of this trainer (pytorch-lightning 2.6).

    - `_SignalConnector.register_signal_handlers` installs, at the start of fit/validate/test, a
      SIGTERM handler that broadcasts from inside the handler (and, for SLURM, a requeue handler that
      saves a checkpoint there; the SLURM environment is already built with auto_requeue=False).
    - `_TrainingEpochLoop._broadcast_sigterm_tensor` broadcasts rank 0's SIGTERM flag and reads it back
      with `.item()` at every training step under DDP: a collective and a host sync per step, needless
      when the template owns the signals.
    tests/test_signals.py fails if either moves in a new Lightning release.
    """
    trainer._signal_connector.register_signal_handlers = lambda: None
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
