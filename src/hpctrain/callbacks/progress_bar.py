"""`progress_bar` (the `callbacks` group's progress): a live rich bar on a terminal, plain periodic log
lines in a file.

SLURM output files are not terminals; a bar redrawn with carriage returns fills them with noise, so
`progress_bar(mode="auto")` picks `LogProgress` whenever stdout is not a TTY.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.report.performance import tensor_parallel
from hpctrain.runtime.report.progress import batch_size_of

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer
    from pytorch_lightning.callbacks import ProgressBar

log = logging.getLogger("hpctrain")


def shown_metrics(trainer: Trainer, shown: dict[str, Any]) -> dict[str, Any]:
    """What a progress display shows: the values the loggers were last given (already plain numbers:
    reading them costs no device synchronisation, unlike `prog_bar=True`, which makes Lightning call
    `.item()` on the value at every step it is logged), plus whatever was logged with prog_bar."""
    logged = {
        k: v
        for k, v in trainer.logged_metrics.items()
        if isinstance(v, (int, float)) and k not in ("epoch", "step")
    }
    return {**shown, **logged}


class RichProgress(LightningPart, lightning="pytorch_lightning.callbacks.RichProgressBar"):
    """Lightning's rich bar, showing what the loggers have (see `shown_metrics`)."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return shown_metrics(trainer, super().get_metrics(trainer, pl_module))


class LogProgress(LightningPart, lightning="pytorch_lightning.callbacks.ProgressBar"):
    """One log line every `every_n_s` seconds during training and one after each validation, on rank 0."""

    def __init__(self, every_n_s: float = 30.0) -> None:
        super().__init__()
        self.every_n_s = every_n_s
        self._enabled = True
        self._last = 0.0
        self._window_samples = 0
        self._window_start = 0.0
        self._total: int | float = 0
        self._before_validation: dict[str, Any] = {}

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch starts without that hook

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last = self._window_start = time.monotonic()
        self._window_samples = 0
        self._total = self.total_train_batches  # a property that does real work: once per epoch

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._window_samples += batch_size_of(batch)
        now = time.monotonic()
        if now - self._last < self.every_n_s and batch_idx + 1 < self._total:
            return
        if not (self._enabled and trainer.is_global_zero):
            return
        # the ranks of a tensor-parallel group train on the same samples: count each group once
        groups = trainer.world_size // tensor_parallel(trainer)
        rate = self._window_samples * groups / max(now - self._window_start, 1e-9)
        total = self._total
        share = f" ({100 * (batch_idx + 1) / total:.0f}%)" if isinstance(total, int) and total else ""
        log.info(
            "epoch %d/%s  step %d/%s%s  %s  %.0f samples/s",
            trainer.current_epoch,
            trainer.max_epochs if trainer.max_epochs not in (None, -1) else "-",
            batch_idx + 1,
            total,
            share,
            self._format(trainer, pl_module, "train/"),
            rate,
        )
        self._last = self._window_start = now
        self._window_samples = 0

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before_validation = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self._enabled and trainer.is_global_zero and not trainer.sanity_checking):
            return
        # What this validation logged, whatever its names (val/acc, val_loss, ...): Lightning puts a new
        # tensor in callback_metrics for every value logged. Plus the monitored metric, always.
        before = self._before_validation
        logged = [k for k, v in trainer.callback_metrics.items() if before.get(k) is not v]
        monitored = [
            c.monitor
            for c in (trainer.checkpoint_callback, trainer.early_stopping_callback)
            if c is not None and getattr(c, "monitor", None)
        ]
        values = trainer.callback_metrics  # once per validation: reading them here costs nothing per step
        names = dict.fromkeys([*monitored, *logged])
        shown = {k: _number(values[k]) for k in names if k in values}
        log.info("epoch %d validation  %s", trainer.current_epoch, _joined(shown))

    def _format(self, trainer: Trainer, pl_module: LightningModule, prefix: str) -> str:
        metrics = shown_metrics(trainer, self.get_metrics(trainer, pl_module))
        return _joined({k: v for k, v in metrics.items() if k.startswith(prefix)})


def _joined(metrics: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def progress_bar(mode: str = "auto", refresh_rate: int = 5, log_every_n_s: float = 30.0) -> ProgressBar:
    """`rich`, `log`, or `auto`: rich on a terminal, log lines otherwise."""
    if mode not in ("auto", "rich", "log"):
        raise ValueError(f"progress mode {mode!r} is not one of auto, rich, log")
    if mode == "rich" or (mode == "auto" and sys.stdout.isatty()):
        return RichProgress(refresh_rate=refresh_rate, leave=True)
    return LogProgress(every_n_s=log_every_n_s)
