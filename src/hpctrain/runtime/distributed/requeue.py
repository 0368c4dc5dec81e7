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
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer

from hpctrain.runtime.distributed import signals, watchdog
from hpctrain.runtime.environment import launched, slurm_job

log = logging.getLogger(__package__)

REQUEUE_WAIT_S = 120  # longer than SLURM needs to terminate a requeued job's tasks
CALIBRATION_STEPS = 10  # with check_every_n_steps=auto: check every step until this many, then agree on k
CHECK_EVERY_S = 1.0  # the aim of auto: one check about every second
TEST_CHECK_EVERY = 10  # test batches between checks when no training step time is known


class RequeueOnSignal(Callback):
    def __init__(
        self, checkpoint_path: str | Path, check_every_n_steps: int | str = "auto", timeout_min: float = 30
    ) -> None:
        self.checkpoint_path = Path(checkpoint_path)
        self.every: int | None = None if check_every_n_steps == "auto" else max(1, int(check_every_n_steps))
        self.timeout = timedelta(minutes=float(timeout_min))
        self._batches = 0
        self._first_step_at: float | None = None
        self._group: Any = None
        self._eval_limit = 0
        self._stop: signals.Interrupted | None = None

    # ------------------------------------------------------------------------------------ agreement

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._group is None and dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            # The flag travels over gloo on the CPU: no device sync is added to a GPU training step. The
            # configured timeout replaces gloo's 30-minute default (a node whose address the others
            # cannot reach then fails within dist.timeout_min, naming the collective).
            if dist.get_backend() == "gloo":
                self._group = dist.group.WORLD
            else:
                self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        if self.every is None and self._group is None:
            self.every = 1  # one process: a check reads a flag and needs no collective, so check every step

    def _agree(self, *values: float) -> list[float]:
        """The largest of each value over all ranks: the recorded signal first, then any measurements."""
        local = [float(signals.received()), *values]
        if self._group is None:
            return local
        flags = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return flags.tolist()

    # ------------------------------------------------------------------------------------ training

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches == 1:
            self._first_step_at = time.perf_counter()  # time from the end of the first (warm-up) step
        # Never stop on an epoch's last batch: its validation has not run yet, and a checkpoint taken
        # there would resume into the next epoch without it. The next step boundary comes soon.
        if batch_idx + 1 >= trainer.num_training_batches:
            return
        if self.every is not None and self._batches % self.every:
            return
        if self.every is None and self._batches >= CALIBRATION_STEPS:
            step_s = (time.perf_counter() - (self._first_step_at or 0.0)) / (self._batches - 1)
            code, slowest = self._agree(step_s)
            self.every = max(1, min(10_000, round(CHECK_EVERY_S / max(slowest, 1e-6))))
            if trainer.is_global_zero:
                log.info(
                    "signals are checked every %d training steps (about every %.1f s)",
                    self.every,
                    self.every * slowest,
                )
        else:
            (code,) = self._agree()
        if code != signals.NO_SIGNAL:
            signals.answered()
            self._stop = self._save(trainer, int(code), "during training")

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Leave only now: Lightning logs a step's metrics after on_train_batch_end, and the resumed run
        # starts after that step, so its log line must reach the loggers before we go.
        if self._stop is None:
            return
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
        raise self._stop

    def after_fit(self, trainer: Trainer) -> None:
        """A signal recorded during the last validation (or otherwise after the last check): save and stop."""
        (code,) = self._agree()
        if code != signals.NO_SIGNAL:
            signals.answered()
            raise self._save(trainer, int(code), "after training")

    def _save(self, trainer: Trainer, code: int, where: str) -> signals.Interrupted:
        # Every rank takes part, rank 0 writes (atomically, see AtomicCheckpointIO), then all wait for it.
        started = time.perf_counter()
        trainer.save_checkpoint(self.checkpoint_path)
        wait_for_saves(trainer)  # checkpoints.async_save: written and in place before the job requeues
        if trainer.is_global_zero:
            log.info(
                "signal received %s: saved %s at step %d in %.1f s",
                where,
                self.checkpoint_path,
                trainer.global_step,
                time.perf_counter() - started,
            )
        trainer.strategy.barrier("checkpoint_on_signal")
        return signals.Interrupted(code, self.checkpoint_path, where)

    # ------------------------------------------------------------------------------------ testing

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_limit = self._smallest(int(sum(trainer.num_test_batches)))

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_limit = self._smallest(int(sum(trainer.num_predict_batches)))

    def _smallest(self, batches: int) -> int:
        # Evaluation and prediction shards are not padded, so ranks may run different numbers of batches:
        # checks happen only below the smallest count, where every rank gets to.
        if self._group is not None:
            smallest = torch.tensor([batches], dtype=torch.int64)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self._group)
            batches = int(smallest.item())
        return batches

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._check_evaluation(batch_idx, "during testing")

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._check_evaluation(batch_idx, "during prediction")

    def _check_evaluation(self, batch_idx: int, where: str) -> None:
        done = batch_idx + 1
        if done >= self._eval_limit or done % (self.every or TEST_CHECK_EVERY):
            return
        (code,) = self._agree()
        if code != signals.NO_SIGNAL:
            signals.answered()
            raise signals.Interrupted(int(code), None, where)


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
        if result.returncode != 0:
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
