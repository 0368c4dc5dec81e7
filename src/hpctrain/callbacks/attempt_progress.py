"""`AttemptProgress`: this attempt's progress in run.yaml (checkpoints, heartbeat, the signal lead)."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from hpctrain.callbacks.requeue_on_signal import RequeueOnSignal
from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.storage import attempts

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.run")


class AttemptProgress(LightningPart, lightning="pytorch_lightning.Callback"):
    """Rank 0 records this attempt's progress in run.yaml (`attempt`): when training started, the last
    checkpoint saved (timed by the checkpoint writer), a sign of life every `attempts.HEARTBEAT_S`. With
    requeue on, it warns once when the slowest save plus the wait for the next signal check does not fit
    in `requeue.signal_lead_s`, the time the signal comes before the time limit."""

    def __init__(
        self,
        attempt: attempts.Attempt | None = None,
        signal_lead_s: float | None = None,
        signal_name: str = "SIGUSR1",
    ) -> None:
        self.attempt = attempt  # this process's attempt (rank 0 records it), or none to record
        self.lead_s = signal_lead_s
        self.signal_name = signal_name
        self._steps: deque[float] = deque(maxlen=50)  # the newest training steps' durations
        self._step_started: float | None = None
        self._seen_save: Any = None
        self._slowest_save_s = 0.0
        self._beat_at = 0.0
        self._warned = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self._record(trained_from={"at": round(time.time(), 3), "step": trainer.global_step})
            self._beat_at = time.monotonic() + attempts.HEARTBEAT_S

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_started is not None:
            self._steps.append(time.perf_counter() - self._step_started)
        self._progress(trainer)

    def _progress(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """A batch or training ended: a save the writer made since is recorded, and a heartbeat when due."""
        if not trainer.is_global_zero:
            return
        # the writer's record of its newest save (an FSDP2 strategy that writes its own shards may keep one)
        strategy = trainer.strategy
        save = getattr(strategy, "last_save", None) or getattr(strategy.checkpoint_io, "last_save", None)
        if save is not None and save is not self._seen_save:
            self._seen_save = save
            self._slowest_save_s = max(self._slowest_save_s, save.seconds)
            self._record(
                saved={
                    "at": round(save.at, 3),
                    "step": save.step,
                    "path": save.path,
                    "seconds": round(save.seconds, 3),
                }
            )
            self._check_signal_lead(trainer)
        if time.monotonic() >= self._beat_at:
            self._record(seen={"at": round(time.time(), 3), "step": trainer.global_step})
            self._beat_at = time.monotonic() + attempts.HEARTBEAT_S

    on_validation_batch_end = on_test_batch_end = on_train_end = _progress

    def _record(self, **fields: Any) -> None:
        if self.attempt is not None:
            self.attempt.record(**fields)

    def _check_signal_lead(self, trainer: Trainer) -> None:
        if self.lead_s is None or self._warned:
            return
        requeue = next((c for c in trainer.callbacks if isinstance(c, RequeueOnSignal)), None)
        every = (requeue.every if requeue is not None else None) or 1
        step_s = statistics.median(self._steps) if self._steps else 0.0
        warning = attempts.slow_save_warning(
            self._slowest_save_s, step_s, every, self.lead_s, self.signal_name
        )
        if warning:
            self._warned = True
            log.warning("%s", warning)
