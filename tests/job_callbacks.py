"""Callbacks the tests put into real jobs (`+callbacks.<name>._target_=tests.job_callbacks.<class>`, with
the project root on PYTHONPATH): unlike tests/differential/user_code.py, they know the template."""

from __future__ import annotations

import os
import time

from pytorch_lightning import Callback

from hpctrain.runtime.distributed import signals


class HoldUntilSignalled(Callback):
    """Holds fit at its start, saying so on stdout, until the process has recorded a signal (at most
    $HOLD_S seconds, 120 by default): a test signals the job at a moment it knows, and the run acts on
    the signal at its next agreed point (the first step's end, or after fit)."""

    def on_fit_start(self, trainer, pl_module):
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(f"holding until signalled (restart {restart})", flush=True)
        deadline = time.monotonic() + float(os.environ.get("HOLD_S", "120"))
        while signals.received() == signals.NO_SIGNAL and time.monotonic() < deadline:
            time.sleep(0.05)


_LEFT_FOR_THE_END: list[object] = []  # a module's globals go last as the interpreter finalizes


class _SlowDestructor:
    """Takes `seconds` to be destroyed, after writing `mark`: what torch's or a logger's destructors do
    as the interpreter finalizes, after CPython stopped running Python signal handlers."""

    def __init__(self, mark: str, seconds: float) -> None:
        self.mark, self.seconds = mark, seconds

    def __del__(self, sleep=time.sleep, write=os.write, fd_open=os.open) -> None:  # globals are gone by then
        fd = fd_open(self.mark, os.O_WRONLY | os.O_CREAT, 0o644)
        write(fd, b"finalizing")
        sleep(self.seconds)


class SlowTeardown(Callback):
    """On rank 0, once the run tested: the process's finalization will take $SLOW_TEARDOWN_S seconds (20),
    after writing $SLOW_TEARDOWN_MARK, so that a test can signal a job that completed its work while its
    process tears down."""

    def on_test_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            seconds = float(os.environ.get("SLOW_TEARDOWN_S", "20"))
            _LEFT_FOR_THE_END.append(_SlowDestructor(os.environ["SLOW_TEARDOWN_MARK"], seconds))
