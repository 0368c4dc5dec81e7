"""`ModelCheckpoint` (the `callbacks` group's model_checkpoint): Lightning's, following the monitored
metric, with hpctrain's commit protocol (the old best is removed only once the new one is saved), and
the best so far carried across a resume into a new run dir; the paths its state names are kept inside
the folders they belong to: a resumed checkpoint may come from someone else, and Lightning would test the
"best" file it names and remove the "worse" ones, wherever they are."""

from __future__ import annotations

import logging
import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.callbacks.monitored_metric import MonitoredMetricMissing, metric_is_due
from hpctrain.callbacks.state_key import CachedStateKey
from hpctrain.runtime.confined import inside
from hpctrain.runtime.environment import launched
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain")
_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")
_SCORES = ("best_model_score", "kth_value")


def _score(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, numbers.Real)
        or (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point())
    )


class ModelCheckpoint(CachedStateKey, LightningPart, lightning="pytorch_lightning.callbacks.ModelCheckpoint"):
    """Lightning's ModelCheckpoint, with `last.ckpt` always the newest state, and a monitored metric that
    is missing after validation as one sentence. With no monitored metric (`monitor: null`) and the
    default `save_top_k: 1`, it keeps last.ckpt only: Lightning's newest-epoch copy would be the same
    state twice (`save_top_k: -1` still keeps every epoch).

    pytorch-lightning 2.6 writes `last.ckpt` only in a step where a top-k checkpoint was saved too
    ("Only save last checkpoint if a checkpoint was actually saved"): with `save_top_k: 1` it is a copy
    of the best epoch, and `ckpt_path=last` or a restart after a node failure would silently redo every
    epoch since the last improvement. Here, wherever Lightning considers saving (the end of each
    validation or training epoch) and when fit ends, `last.ckpt` is brought up to the current step.
    """

    _last_saved_at: int | None = None  # the global step last.ckpt holds
    _validated = False  # a validation (not the sanity check) ended in this process
    _carried_said = False  # the earlier run's best, carried into this run dir, has been said
    _resumed_dir: str | None = None  # the folder of the checkpoint resumed from (setup)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.monitor is None and self.save_top_k == 1:
            self.save_top_k = 0
        self._pending_removals: list[str] = []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume in the same run dir (a requeue) restores everything, as Lightning does. A resume into a
        new run dir (`ckpt_path=last` or a path: every run has its own dir) gets, from Lightning, only the
        earlier best's path and no score: the first validation after it would then be named the best
        however bad, while the module's own best metric (`val/acc_best`) and the value returned to sweepers
        remember the earlier one. Here the earlier run's best checkpoints and scores stay the run's best, in
        the earlier run dir (never removed from there), as long as their files exist; this run's epochs
        replace them only by being better. Where they are gone, this run's best is picked among its own
        epochs, said once.

        The state is a file's: only paths inside this callback's folder, or inside the folder of the
        checkpoint resumed from (symlinks followed), and scores that are numbers are taken; the rest is
        dropped, with one warning."""
        state = self._confined(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            super().load_state_dict(state)
            return
        saved: dict[str, Any] = dict(state.get("best_k_models") or {})
        if not saved and state.get("best_model_path"):
            saved = {state["best_model_path"]: state.get("best_model_score")}
        kept = {path: score for path, score in saved.items() if score is not None and os.path.exists(path)}
        self.best_k_models = kept
        if kept:
            better = min if self.mode == "min" else max
            self.best_model_path = better(kept, key=lambda p: float(kept[p]))
            self.best_model_score = kept[self.best_model_path]
            if len(kept) == self.save_top_k:  # full: the worst of them is the one a better epoch replaces
                worse = max if self.mode == "min" else min
                self.kth_best_model_path = worse(kept, key=lambda p: float(kept[p]))
                self.kth_value = kept[self.kth_best_model_path]
        if self._carried_said or not launched.is_rank_zero():
            return  # said once: the test after fit restores the tested checkpoint's state again
        self._carried_said = True
        gone = sorted(set(saved) - set(kept))
        if kept:
            log.info(
                "the best checkpoint so far is the earlier run's %s (%s=%.4g); an epoch of this run replaces "
                "it only if it is better",
                self.best_model_path,
                self.monitor,
                float(self.best_model_score),  # type: ignore[arg-type]
            )
        if gone:
            log.warning(
                "the earlier run's best checkpoint(s) %s are gone: this run's best is picked among the epochs "
                "it trains, though %s's best so far (a metric the model keeps, the value a sweep gets) may be "
                "an earlier epoch's",
                ", ".join(gone),
                self.monitor,
            )

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self.resuming_from(trainer.ckpt_path)  # Lightning calls load_state_dict next

    def resuming_from(self, checkpoint: str | Path | None) -> None:
        """The checkpoint this run resumes from: the paths its state names may lie in its folder too."""
        self._resumed_dir = str(Path(checkpoint).parent) if checkpoint else None

    def _confined(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state with every path outside this callback's folder and the resumed checkpoint's folder, and
        every score that is not a number, dropped (said once)."""
        state, dropped = dict(state_dict), []
        for key in _PATHS:
            path = state.get(key)
            if path and not (isinstance(path, str) and self._kept(path, None)):
                state[key] = ""
                dropped.append(f"{key}={str(path)[:120]}")
        models = state.get("best_k_models")
        if models is not None:
            models = models if isinstance(models, dict) else {"(not a mapping)": None}
            kept = {p: v for p, v in models.items() if v is not None and self._kept(p, v)}
            dropped += [f"best_k_models: {str(p)[:120]}" for p in models if p not in kept]
            state["best_k_models"] = kept
        for key in _SCORES:
            if not _score(state.get(key)):
                state[key] = None
                dropped.append(key)
        if dropped:
            log.warning(
                "the checkpoint's %s state names %s outside %s (or not a score): %s dropped, so nothing outside "
                "the run's checkpoints is read or removed",
                type(self).__name__,
                dropped[0],
                self.dirpath,
                "it is" if len(dropped) == 1 else f"those {len(dropped)} are",
            )
        state.setdefault("best_model_score", None)  # Lightning reads both unconditionally
        state.setdefault("best_model_path", "")
        return state

    def _kept(self, path: Any, score: Any) -> bool:
        folders = [f for f in (self.dirpath, self._resumed_dir) if f]
        return isinstance(path, str) and _score(score) and any(inside(path, f) for f in folders)

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Lightning removes the previous best right after saving the new one, while last.ckpt (what a
        restart resumes from) still names the previous best as the run's best: a kill before last.ckpt is
        saved again would leave it naming a checkpoint that is gone. The removal waits until last.ckpt is
        up to date, at the end of the same hook (`_removals_done`). Never a path outside the folder."""
        if not (self.dirpath and inside(filepath, self.dirpath)):
            log.warning("not removing %s: it lies outside %s", filepath, self.dirpath)
            return
        if self.save_last:
            self._pending_removals.append(filepath)
        else:
            super()._remove_checkpoint(trainer, filepath)

    def _removals_done(self, trainer: Trainer) -> None:
        pending, self._pending_removals = self._pending_removals, []
        kept = {self.best_model_path, self.last_model_path, *self.best_k_models}
        for filepath in pending:
            if filepath not in kept:
                super()._remove_checkpoint(trainer, filepath)

    def stop_monitoring(self) -> None:
        """Keep last.ckpt only from now on (the model logs no metric: see MonitoredMetric)."""
        self.monitor = None
        if self.save_top_k == 1:
            self.save_top_k = 0

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_saved_at = trainer.global_step

    def _bring_last_up_to_date(self, trainer: Trainer) -> None:
        if (
            not self.save_last
            or trainer.fast_dev_run
            or trainer.sanity_checking
            or trainer.state.fn != "fit"
            or self._last_saved_at == trainer.global_step
        ):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated = True
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._bring_last_up_to_date(trainer)
        self._removals_done(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._bring_last_up_to_date(trainer)
        self._removals_done(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._bring_last_up_to_date(trainer)
        self._removals_done(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        # Lightning's version works out at every step whether to save by step count or by time; when
        # neither is configured (checkpoints at validation), that answer is always no.
        if self._every_n_train_steps >= 1 or self._train_time_interval is not None:
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
            self._removals_done(trainer)

    def _save_topk_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        if self.monitor is not None and self.save_top_k != 0 and self.monitor not in monitor_candidates:
            if metric_is_due(trainer, self._validated):
                raise MonitoredMetricMissing(self.monitor, monitor_candidates)
            return  # before the first validation (a short run): nothing to rank yet, last.ckpt is kept
        super()._save_topk_checkpoint(trainer, monitor_candidates)
