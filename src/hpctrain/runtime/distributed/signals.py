"""The template owns SIGTERM and the requeue signal for the whole run; the handlers only record.

Python runs a signal handler between two bytecodes of whatever the main thread is doing, possibly in
the middle of a backward pass. A handler that saves a checkpoint or runs a collective there (as
Lightning's SLURM auto-requeue handler does, and its SIGTERM handler, which broadcasts) can meet
another rank sitting in a different collective: the job hangs. So `install` (called before any heavy
import, so a signal during startup is recorded too) replaces both handlers with ones that only
remember the strongest signal seen, and `take_over_from_lightning` stops Lightning from installing
its own and from broadcasting a SIGTERM flag at every training step. `hpctrain.runtime.distributed.requeue` acts on the
record at points where every rank takes the same collective path.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NO_SIGNAL, TERMINATE, REQUEUE = 0, 1, 2


@dataclass
class _Recorded:
    received: int = NO_SIGNAL  # the strongest signal recorded so far
    requeue_signal: signal.Signals | None = None  # the one that requeues (the SLURM time-limit warning)
    early: set[int] = field(default_factory=set)  # arrived during startup, before install()


_state = _Recorded()


class Interrupted(Exception):
    """The run stopped on a recorded signal, at a point every rank agreed on (see
    hpctrain.runtime.distributed.requeue); `checkpoint` (if any) holds everything to continue from."""

    def __init__(self, code: int, checkpoint: Path | None, where: str) -> None:
        from hpctrain.runtime import cluster

        name = requeue_signal_name() if code == REQUEUE else "SIGTERM"
        super().__init__(f"{name} {where}" + (f": saved {checkpoint}" if checkpoint else ""))
        self.code = code
        self.checkpoint = checkpoint
        self.requeue = code == REQUEUE and cluster.slurm_job_id() is not None


def _record(signum: int, frame: Any) -> None:
    code = REQUEUE if signum == _state.requeue_signal else TERMINATE
    _state.received = max(_state.received, code)


EARLY = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def install_early() -> None:
    """At the very start of an entry point, before the config says which signal requeues: record
    SIGTERM, SIGUSR1 and SIGUSR2, so a signal during startup is never lost (their default is to kill)."""
    for sig in EARLY:
        signal.signal(sig, _record_early)


def _record_early(signum: int, frame: Any) -> None:
    _state.early.add(signum)


def install(requeue_signal: str | None) -> None:
    """From now on record SIGTERM and `requeue_signal` (the SLURM time-limit warning, e.g. SIGUSR1),
    counting what arrived during startup. With `requeue_signal=None` (requeue disabled) the default
    actions come back, and a signal that arrived during startup ends the process now."""
    early, _state.early = _state.early, set()
    chosen = signal.Signals[requeue_signal] if requeue_signal else None
    _state.requeue_signal = chosen
    _state.received = NO_SIGNAL
    for sig in EARLY:
        signal.signal(sig, signal.SIG_DFL)
    if chosen is None:
        for signum in early:
            signal.raise_signal(signum)
        return
    signal.signal(signal.SIGTERM, _record)
    signal.signal(chosen, _record)
    for signum in early:
        if signum in (signal.SIGTERM, chosen):
            _record(signum, None)


def received() -> int:
    """The strongest signal recorded in this process (NO_SIGNAL, TERMINATE or REQUEUE)."""
    return _state.received


def requeue_signal_name() -> str:
    sig = _state.requeue_signal
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
