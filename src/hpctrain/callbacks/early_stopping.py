"""`EarlyStopping` (the `callbacks` group's early_stopping): Lightning's, following the monitored metric."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.callbacks.monitored_metric import MonitoredMetricMissing, metric_is_due
from hpctrain.callbacks.state_key import CachedStateKey
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer


class EarlyStopping(CachedStateKey, LightningPart, lightning="pytorch_lightning.callbacks.EarlyStopping"):
    """Lightning's EarlyStopping; a monitored metric that is missing is one sentence. With no monitored
    metric (`monitor: null`, or a model that logs none) it never stops a run, and before the first
    validation of a run that validates (a short run's only epoch, cut by max_steps) it has nothing to
    compare yet (`metric_is_due`)."""

    _validated = False  # a validation (not the sanity check) ended in this process

    def stop_monitoring(self) -> None:
        self.monitor = None  # type: ignore[assignment]

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated = True
        super().on_validation_end(trainer, pl_module)

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        if self.monitor is None:
            return
        if self.monitor not in trainer.callback_metrics and not metric_is_due(trainer, self._validated):
            return
        super()._run_early_stopping_check(trainer)

    def _validate_condition_metric(self, logs: dict[str, Any]) -> bool:
        if self.strict and self.monitor not in logs:
            if not logs:
                return (
                    False  # nothing logged at all: MonitoredMetric decides (it stops monitoring or refuses)
                )
            raise MonitoredMetricMissing(self.monitor, logs)
        return super()._validate_condition_metric(logs)
