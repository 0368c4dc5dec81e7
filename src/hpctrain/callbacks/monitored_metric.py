"""`MonitoredMetric`: the monitored metric (`monitor.metric`, `monitor.mode`), checked as soon as metrics
exist and tracked for sweepers; every run gets it from `build`.

A module that never logs the monitored metric (or a typo in `monitor.metric`) would otherwise train a
whole epoch and then crash inside ModelCheckpoint or EarlyStopping; here the run stops at the end of
the sanity check (or at the first validation, or, for a module without validation, at the first
training epoch's end) with one sentence naming the metric, what was logged, and the override that
fixes it.

A run that ends before its first validation (`trainer.max_steps=5`, a `max_time`, `limit_val_batches=0`)
is a short run, not a mistake: the metric is not missing, it is not computed yet. It completes with
last.ckpt and one line saying that no validation ran (`metric_is_due` decides, for this callback and the
template's ModelCheckpoint and EarlyStopping alike).
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart, is_overridden

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.run")

DATALOADER_SUFFIX = "/dataloader_idx_"  # Lightning's suffix with several validation dataloaders


class MonitoredMetricMissing(UserError):
    def __init__(self, metric: str, logged: Iterable[str]) -> None:
        names = sorted(logged)
        suffixed = [n for n in names if n.startswith(f"{metric}{DATALOADER_SUFFIX}")]
        close = difflib.get_close_matches(metric, names, n=1)
        if suffixed:  # several validation dataloaders: Lightning names the metric once per dataloader
            hint = f"with several validation dataloaders pass one of them, e.g. monitor.metric={suffixed[0]}"
        elif close:
            hint = f"did you mean monitor.metric={close[0]}?"
        else:
            hint = "pass monitor.metric=<one of them>"
        super().__init__(
            f"monitor.metric={metric} is never logged by the model (it logged: {', '.join(names)}); {hint} "
            "(and monitor.mode=min or max)."
        )


class NothingLogged(UserError):
    def __init__(self, metric: str) -> None:
        super().__init__(
            f"monitor.metric={metric} is never logged: the model logs no metric at all, and a sweep compares its "
            f"points by the monitored metric; log it in validation_step with self.log('{metric}', ...) (or pass "
            "monitor.metric=<a name it logs>)."
        )


def has_validation(trainer: Trainer) -> bool:
    """Whether the run's code validates at all: a validation_step and a val_dataloader (the module's or the
    datamodule's), whatever `limit_val_batches` says."""
    module = trainer.lightning_module
    if not is_overridden("validation_step", module):
        return False
    return any(o is not None and is_overridden("val_dataloader", o) for o in (trainer.datamodule, module))


def metric_is_due(trainer: Trainer, validated: bool) -> bool:
    """Whether a monitored metric missing now is a mistake: a validation ran in this process (not the sanity
    check) and did not log it, or the code has no validation, so the metric can only come from training.
    Before the first validation of a run that validates, it is not computed yet (a short run)."""
    return validated or not has_validation(trainer)


def no_validation_note(metric: str, trainer: Trainer) -> str:
    """The line a run that ended before its first validation says about its monitored metric."""
    if trainer.limit_val_batches == 0:
        why = "no validation ran (trainer.limit_val_batches=0)"
    else:
        limit = trainer.max_steps
        cap = (
            f" (trainer.max_steps={limit})"
            if limit not in (None, -1) and trainer.global_step >= limit
            else ""
        )
        why = f"no validation ran: training ended at step {trainer.global_step}{cap}, before the first one"
    checkpoint = trainer.checkpoint_callback
    kept = (
        "last.ckpt holds the weights it ended with and the test after fit uses them"
        if checkpoint is not None and getattr(checkpoint, "save_last", False)
        else "the test after fit uses the weights it ended with"
    )
    return f"{why}, so monitor.metric={metric} has no value and this run has no best checkpoint; {kept}."


def no_monitor_note(metric: str | None) -> str:
    why = (
        "monitor.metric=null"
        if metric is None
        else f"the model logs no metric, so monitor.metric={metric} cannot be followed"
    )
    return (
        f"{why}: this run keeps last.ckpt only (no best checkpoint, no early stopping) and the test after fit "
        "uses last.ckpt; log a metric with self.log and pass monitor.metric=<its name> to keep the best."
    )


class MonitoredMetric(LightningPart, lightning="pytorch_lightning.Callback"):
    """Checks once that `metric` is logged and keeps its best value under `mode` (what train.py returns).

    A model that logs no metric at all (Lightning's demo BoringModel) trains as under bare Lightning
    with a plain checkpoint callback: this callback then stops monitoring, the template's checkpoint and
    early-stopping callbacks that followed `metric` too (`stop_monitoring`), and says so once. In a sweep
    (`sweep=True`), which compares its points by this value, that is refused instead.
    Put it before those callbacks: it decides before they look at the metric.
    """

    def __init__(self, metric: str, mode: str = "max", sweep: bool = False) -> None:
        if mode not in ("min", "max"):
            raise UserError(
                f"monitor.mode={mode} is not min or max; pass monitor.mode=max or monitor.mode=min."
            )
        self.metric: str | None = metric
        self.mode = mode
        self.sweep = sweep
        self.best: float | None = None
        self._checked = False
        self._validated = False

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # With several validation dataloaders Lightning has already cleared the sanity check's metrics
        # here, and a model may log nothing in validation: with no names yet, decide at the first validation.
        if trainer.callback_metrics:
            self._check(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validated = True
        self._check(trainer)
        self._record(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not has_validation(trainer):  # its metrics come from training only: they exist by now
            self._check(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        missing = self.metric is not None and self.metric not in trainer.callback_metrics
        if missing and not metric_is_due(trainer, self._validated):  # a short run: not computed yet
            if trainer.is_global_zero:
                log.info(no_validation_note(str(self.metric), trainer))
            return
        self._check(trainer)
        if not self._validated:  # no validation: the value the last epoch ended with
            self._record(trainer)

    def _check(self, trainer: Trainer) -> None:
        if self._checked or self.metric is None:
            return
        self._checked = True
        if self.metric in trainer.callback_metrics:
            return
        if trainer.callback_metrics:
            raise MonitoredMetricMissing(self.metric, trainer.callback_metrics)
        if self.sweep:
            raise NothingLogged(self.metric)
        if trainer.is_global_zero:
            log.warning(no_monitor_note(self.metric))
        for callback in trainer.callbacks:  # the template's ModelCheckpoint and EarlyStopping
            stop = getattr(callback, "stop_monitoring", None)
            if callable(stop) and getattr(callback, "monitor", None) == self.metric:
                stop()
        self.metric = None

    def _record(self, trainer: Trainer) -> None:
        if self.metric is None:
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None or value.numel() != 1:
            return
        value = float(value)
        if math.isnan(value):
            return
        if self.best is None or (value > self.best if self.mode == "max" else value < self.best):
            self.best = value

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
