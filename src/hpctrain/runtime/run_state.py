"""The state of the run in progress (and of the sweep around it), owned by objects that begin and end
with it.

Each concern keeps its state in an owner class of its own module (`signals.SignalRecord`,
`failures.Failures`, `notify.Notifier`, `positions.Followed`, `stacks.Registered`,
`watchdog.Watching`, `job_store.DataParallel`; a sweep's `job.Skipped`); this
module holds one instance of each for the current run, made on first use (`part`):

    run_state.part(Failures).verdict        # this run's Failures, created if it is the first use

Why one holder and not an object passed around: the places that record state are process-wide
(signal handlers, sys.excepthook, faulthandler, atexit, threads such as the watchdog), and reach
the run only through the process. Why a holder at all, and not a singleton per module: a Hydra
multirun with the basic launcher runs the jobs of a sweep in turn in one process, and a signal, a
failure verdict, a followed trainer or a faulthandler registration the first job leaves must not
reach the second. `hpctrain.runtime.run.job.job` begins a run as it enters and ends it as it exits:

- `begin()`: a fresh state for this run. Only what an owner hands over explicitly reaches it: a signal
  recorded during startup (`signals.install_early`), which belongs to the run about to begin.
- `end()`: every owner with a `close()` stops what it still runs (the watchdog thread, the stop guard,
  the faulthandler registration), newest first. The ended run's state stays readable until the next
  `begin`: what runs after the job (the sweep reading a failed job's verdict, `entry.end` reading
  whether this rank finished) reads the run it follows.

A sweep's state (`sweep_part`) lives from `begin_sweep()` to `end_sweep()` (the sweep's summary callback,
`hpctrain.runtime.sweeps.sweep_summary.SweepSummary`), around the runs of its jobs.

Standard library only: imported by the preflight path, before torch, and below every other layer.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("hpctrain")


class State:
    """One run's (or one sweep's) owners: one instance per owner class, made on first use."""

    def __init__(self) -> None:
        self._parts: dict[type, Any] = {}
        self._closed: set[type] = set()  # owners whose close() has run
        self.ended = False  # the run has ended (`close`)

    def part(self, cls: type[T]) -> T:
        found = self._parts.get(cls)
        if found is None:
            # no lock: a signal handler may get here while the main thread is in here too; setdefault
            # is one atomic step for a dict keyed by classes, and whoever comes second gets the first
            found = self._parts.setdefault(cls, cls())
        return found

    def peek(self, cls: type[T]) -> T | None:
        """This state's instance of `cls` if it has one (made by nobody here: a forked child's hook)."""
        return self._parts.get(cls)

    def close(self) -> None:
        """Each owner's `close()`, newest first (one that fails does not keep the others running). Again
        later, it closes only the owners made since: what a test or the next sweep point made after `end`."""
        self.ended = True
        for cls, owner in reversed(list(self._parts.items())):
            if cls in self._closed:
                continue
            self._closed.add(cls)
            close = getattr(owner, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.exception("ending the run's %s failed", type(owner).__name__)


_run = State()  # the current run; before the first one, what the process records during startup
_sweep = State()  # the current sweep's


def part(cls: type[T]) -> T:
    """The current run's instance of `cls` (made now if this is its first use)."""
    return _run.part(cls)


def current() -> State:
    return _run


def begin() -> State:
    """A run begins with a fresh state. An owner with `hand_over(next_run)` passes on what belongs to the
    next run (the signals recorded during startup); everything else of the previous state is dropped."""
    global _run
    before, _run = _run, State()
    for owner in list(before._parts.values()):
        hand_over = getattr(owner, "hand_over", None)
        if callable(hand_over):
            hand_over(_run)
    before.close()  # a run that never ended (it should have): nothing of it keeps running
    return _run


def end() -> None:
    """The run ends: whatever it still runs is stopped; its state stays readable until the next `begin`."""
    _run.close()


def sweep_part(cls: type[T]) -> T:
    """The current sweep's instance of `cls` (made now if this is its first use)."""
    return _sweep.part(cls)


def begin_sweep() -> None:
    global _sweep
    _sweep.close()
    _sweep = State()


def end_sweep() -> None:
    """The sweep has ended (and been reported): the next one starts with nothing of it."""
    global _sweep
    _sweep.close()
    _sweep = State()
