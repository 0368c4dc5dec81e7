"""`RequeueOnSignal`: on a recorded signal, checkpoint where every rank agrees, then requeue or stop
(the protocol: `hpctrain.runtime.distributed.requeue`; added by `build` when `requeue.enabled`)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpctrain.runtime.distributed import signals
from hpctrain.runtime.distributed.requeue import (
    CALIBRATION_STEPS,
    CHECK_EVERY_S,
    TEST_CHECK_EVERY,
    wait_for_saves,
)
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.distributed")


class RequeueOnSignal(LightningPart, lightning="pytorch_lightning.Callback"):
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

    def _evaluation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        """A test or predict batch completed (the hooks' last argument, dataloader_idx, does not matter)."""
        done = batch_idx + 1
        if done >= self._eval_limit or done % (self.every or TEST_CHECK_EVERY):
            return
        (code,) = self._agree()
        if code != signals.NO_SIGNAL:
            signals.answered()
            where = "during testing" if trainer.testing else "during prediction"
            raise signals.Interrupted(int(code), None, where)

    on_test_batch_end = on_predict_batch_end = _evaluation_batch_end
