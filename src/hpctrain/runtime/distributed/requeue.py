"""Preemption and the time limit: act on a recorded signal where every rank agrees, then requeue or stop.

The protocol (why Lightning's own auto-requeue is off, what is saved, how the job comes back) is
described once, in the SLURM guide (docs/guides/slurm.md, "Preemption, requeue and exact resume"). In short: the handlers
of `hpctrain.runtime.distributed.signals` only record; all ranks combine their records in one tiny all-reduce at agreed
points, and if any rank was signalled, all of them act:

- during training, at a step boundary (every `check_every_n_steps` steps; `auto`: about once a
  second, agreed from the measured step time): save requeue.ckpt together and leave fit;
- after fit (a signal during the last validation): save requeue.ckpt, skip the test;
- during testing or prediction, at a batch boundary every rank reaches: stop (the restarted job tests
  or predicts again; training is complete in its checkpoint, and predictions are written only at the end).

Then `requeue_and_wait`: on the requeue signal under SLURM, rank 0 runs `scontrol requeue` and every
rank waits for SLURM to end it (a point of a packed job ends instead, and its driver requeues); on
SIGTERM the process exits with status 143 (130 after Ctrl-C).
"""

from __future__ import annotations

import contextlib
import logging
import signal as signal_module
import sys
import time
from typing import TYPE_CHECKING

from hpctrain.runtime.distributed import signals, watchdog
from hpctrain.runtime.environment import launched, slurm_job

if TYPE_CHECKING:
    from pytorch_lightning import Trainer

log = logging.getLogger(__package__)


REQUEUE_WAIT_S = 120  # longer than SLURM needs to terminate a requeued job's tasks
CALIBRATION_STEPS = 10  # with check_every_n_steps=auto: check every step until this many, then agree on k
CHECK_EVERY_S = 1.0  # the aim of auto: one check about every second
TEST_CHECK_EVERY = 10  # test batches between checks when no training step time is known


def wait_for_saves(trainer: Trainer) -> None:
    """Until every asynchronous checkpoint write (checkpoints.async_save) is complete and in place."""
    for owner in (trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None)):
        wait = getattr(owner, "wait_for_saves", None)
        if callable(wait):
            wait()


def _flush_output() -> None:
    """Every log handler's and stream's buffered output to its file (a job's output file is not a
    terminal: Python holds its lines in a buffer that a killed process loses)."""
    for logger in (logging.getLogger(), log, logging.getLogger("hpctrain")):
        for handler in logger.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def requeue_and_wait(interrupted: signals.Interrupted, wait_s: float = REQUEUE_WAIT_S) -> None:
    """After the run has unwound: on the requeue signal under SLURM, global rank 0 asks SLURM to requeue
    the job and every rank waits for SLURM to end this run of it; otherwise the process exits (143).

    A task that exits by itself races the requeue: its step and then the batch script finish, and
    SLURM can record the job as FAILED instead of pending again. So no rank exits; SLURM's requeue
    terminates them all (the wait only runs out if the requeue failed).
    """
    watchdog.stop()  # ranks now end in any order: not a failure
    if interrupted.requeue and launched.pack_point() is not None:
        # A point of a packed job: `scontrol requeue` would requeue the points beside it mid-step, so it
        # only ends, saved and recorded as requeued (re-raised: Job ends it with status 0), and the pack's
        # driver requeues the allocation once every point has saved or ended (hpctrain.runtime.sweeps.pack).
        if launched.is_rank_zero():
            log.info(
                "saved for the requeue of SLURM job %s, left to its pack (%s)",
                launched.slurm_job_id(),
                interrupted,
            )
        raise interrupted
    if not interrupted.requeue:
        if launched.is_rank_zero():
            log.info("stopped on %s", interrupted)
        sys.exit(signals.exit_code())  # 143 after SIGTERM, 130 after Ctrl-C
    if launched.is_rank_zero():
        result = slurm_job.requeue_job()
        # scontrol ended by a signal (returncode < 0): the requeue it asked for is under way and SLURM is
        # ending this attempt's processes, scontrol first; not a failure (exiting 1 here would record the
        # attempt as failed, and the next one could not tell that this one was requeued at its step)
        if result.returncode > 0:
            log.error(
                "scontrol requeue %s failed: %s",
                launched.slurm_job_id(),
                (result.stderr or result.stdout).strip(),
            )
            sys.exit(1)
        log.info("requeued SLURM job %s (%s)", launched.slurm_job_id(), interrupted)
    _flush_output()  # SLURM ends this run any moment now: what it logged must be in the job's file first
    signal_module.signal(signal_module.SIGTERM, signal_module.SIG_DFL)
    time.sleep(wait_s)
