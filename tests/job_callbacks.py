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
