"""Preemption: checkpoint at a step boundary that every rank agrees on, then requeue and exit.

The protocol (why Lightning's own auto-requeue is off, what is saved, how the job comes back) is
described once, in slurm/README.md, "Preemption, requeue and exact resume". In short: the signal
handler only records the signal; every `check_every_n_steps` training batches all ranks combine their
flags in one tiny all-reduce; if any rank was signalled, all of them save requeue.ckpt together,
leave `trainer.fit` through `TrainingInterrupted`, and `requeue_and_wait` asks SLURM to requeue the job.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer

from hpctrain import cluster

log = logging.getLogger("hpctrain")

NO_SIGNAL, TERMINATE, REQUEUE = 0, 1, 2
REQUEUE_WAIT_S = 120  # longer than SLURM needs to terminate a requeued job's tasks


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving `checkpoint`; `requeue` asks SLURM to restart the job."""

    def __init__(self, signal_name: str, checkpoint: Path, requeue: bool) -> None:
        super().__init__(f"{signal_name}: saved {checkpoint}" + (", requeueing" if requeue else ""))
        self.signal_name = signal_name
        self.checkpoint = checkpoint
        self.requeue = requeue


class CheckpointOnSignal(Callback):
    def __init__(
        self,
        checkpoint_path: str | Path,
        requeue_signal: str | None = "SIGUSR1",
        check_every_n_steps: int = 1,
    ) -> None:
        self.checkpoint_path = Path(checkpoint_path)
        self.requeue_signal = signal.Signals[requeue_signal] if requeue_signal else None
        self.check_every_n_steps = max(1, int(check_every_n_steps))
        self.received = NO_SIGNAL
        self._batches = 0
        self._group: Any = None
        self._stop: TrainingInterrupted | None = None

    def _record(self, signum: int, frame: Any) -> None:
        code = REQUEUE if signum == self.requeue_signal else TERMINATE
        self.received = max(self.received, code)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Early, so a time-limit signal during startup is recorded rather than killing the process.
        if self.requeue_signal is not None:
            signal.signal(self.requeue_signal, self._record)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning installed its own SIGTERM handler (which broadcasts from inside the handler); replace
        # it for the duration of fit. Lightning restores the previous handlers when fit ends.
        signal.signal(signal.SIGTERM, self._record)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            # The flag travels over gloo on the CPU: no device sync is added to a GPU training step.
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        # Never stop on an epoch's last batch: its validation has not run yet, and a checkpoint taken
        # there would resume into the next epoch without it. The next step boundary comes soon.
        if self._batches % self.check_every_n_steps or batch_idx + 1 >= trainer.num_training_batches:
            return
        agreed = self._agree(trainer)
        if agreed == NO_SIGNAL:
            return
        self._save(trainer)
        requeue = agreed == REQUEUE and cluster.slurm_job_id() is not None
        name = self.requeue_signal.name if agreed == REQUEUE and self.requeue_signal else "SIGTERM"
        self._stop = TrainingInterrupted(name, self.checkpoint_path, requeue)

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

    def _agree(self, trainer: Trainer) -> int:
        """The largest signal any rank has recorded: one all-reduce of a single integer.

        (An asynchronous all-reduce read one check later would hide its latency, but gloo work still
        in flight at interpreter exit aborted processes now and then; the blocking one costs less
        than the noise of the benchmark.)
        """
        if self._group is None:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._group = None  # let destroy_process_group free it

    def _save(self, trainer: Trainer) -> None:
        # Every rank takes part, rank 0 writes (atomically, see AtomicCheckpointIO), then all wait for it.
        trainer.save_checkpoint(self.checkpoint_path)
        if trainer.is_global_zero:
            log.info("signal received: saved %s at step %d", self.checkpoint_path, trainer.global_step)
        trainer.strategy.barrier("checkpoint_on_signal")


def requeue_and_wait(interrupted: TrainingInterrupted, wait_s: float = REQUEUE_WAIT_S) -> None:
    """After fit has unwound: global rank 0 asks SLURM to requeue the job, and every rank waits for
    SLURM to end this run of it.

    A task that exits by itself races the requeue: its step and then the batch script finish, and
    SLURM can record the job as FAILED instead of pending again. So no rank exits; SLURM's requeue
    terminates them all (the wait only runs out if the requeue failed).
    """
    if not interrupted.requeue:
        return
    if cluster.is_rank_zero():
        result = cluster.requeue_job()
        if result.returncode != 0:
            log.error(
                "scontrol requeue %s failed: %s",
                cluster.slurm_job_id(),
                (result.stderr or result.stdout).strip(),
            )
            return
        log.info("requeued SLURM job %s; it resumes from %s", cluster.slurm_job_id(), interrupted.checkpoint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(wait_s)
