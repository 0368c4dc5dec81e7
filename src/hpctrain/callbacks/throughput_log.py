"""`ThroughputLog` (the `callbacks` group's throughput): samples per second and step times, logged."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.report.performance import tensor_parallel
from hpctrain.runtime.report.progress import batch_size_of, seconds_since_process_start, tokens_of

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain")


class ThroughputLog(LightningPart, lightning="pytorch_lightning.Callback"):
    """Logs `train/samples_per_s` once per epoch: the samples all ranks trained on per second of
    training steps (validation, and the checkpointing that follows it, are not counted; the ranks of a
    tensor-parallel group share their samples, counted once), and once per run how long after the
    process started the first training step began.

    For token batches (a mapping with `labels`, -100 where no loss is taken: padding, masked prompts) it
    logs `train/tokens_per_s` at every logging step (`trainer.log_every_n_steps`): the tokens a loss was
    taken on since the last one, all ranks together, per second. They are counted on the device, so no
    step waits for the count.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.tokens: Any = None  # a device tensor, for token batches
        self.seconds = 0.0
        self._logged: tuple[Any, float] = (0, 0.0)  # the tokens and seconds at the last logging step
        self._started: float | None = None
        self._first_step_logged = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_step_logged = False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.samples, self.seconds, self._started = 0, 0.0, time.perf_counter()
        self.tokens, self._logged = None, (0, 0.0)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None:  # resuming after a validation inside the epoch
            self._started = time.perf_counter()
        if not self._first_step_logged:
            self._first_step_logged = True
            age = seconds_since_process_start()
            if age is not None and trainer.is_global_zero:
                log.info("first training step %.2f s after the process started", age)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += batch_size_of(batch)
        counted = tokens_of(batch)
        if counted is None:
            return
        self.tokens = counted if self.tokens is None else self.tokens + counted
        if trainer._logger_connector.should_update_logs:  # as Lightning's LearningRateMonitor asks
            seconds = self.seconds + time.perf_counter() - (self._started or time.perf_counter())
            if seconds > self._logged[1]:
                pl_module.log(
                    "train/tokens_per_s",
                    (self.tokens - self._logged[0]).double()
                    / (seconds - self._logged[1])
                    / tensor_parallel(trainer),
                    on_step=True,
                    sync_dist=True,  # a logging step: every rank logs
                    reduce_fx="sum",
                )
            self._logged = (self.tokens, seconds)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()
        if self.seconds > 0:
            # Summed over ranks at the epoch end, where every rank already synchronises.
            pl_module.log(
                "train/samples_per_s",
                self.samples / self.seconds / tensor_parallel(trainer),
                on_epoch=True,
                sync_dist=True,
                reduce_fx="sum",
            )

    def _pause(self) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
