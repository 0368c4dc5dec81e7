"""The callbacks of a run's machinery:

- `ModelCheckpoint` and `EarlyStopping` (the `callbacks` group's model_checkpoint and early_stopping):
  Lightning's, following the monitored metric, the checkpoint one with hpctrain's commit protocol (the
  old best is removed only once the new one is saved);

and those every run gets from `build`:

- `MonitoredMetric`: the monitored metric (`monitor.metric`, `monitor.mode`), checked as soon as metrics
  exist and tracked for sweepers;
- `SharedRunDirCheck`: every rank of a multi-node fit writes to one shared run dir;
- `AttemptProgress`: this attempt's progress in run.yaml (checkpoints, heartbeat, the signal lead);
- `RankWatchdog`: the rank watchdog, the stop guard, where each rank is, collective timeouts, streams.

A module that never logs the monitored metric (or a typo in `monitor.metric`) would otherwise train a
whole epoch and then crash inside ModelCheckpoint or EarlyStopping; here the run stops at the end of
the sanity check (or at the first validation, or when training ends if there is none) with one
sentence naming the metric, what was logged, and the override that fixes it.
"""

from __future__ import annotations

import difflib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning import Callback, LightningModule, Trainer

from hpctrain.runtime.distributed import failures, launch, positions, signals, watchdog
from hpctrain.runtime.distributed.requeue import RequeueOnSignal
from hpctrain.runtime.distributed.stragglers import StepClock, StragglerReport
from hpctrain.runtime.distributed.streams import shares_itself_out
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run import attempts

log = logging.getLogger(__package__)


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


class MonitoredMetric(Callback):
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

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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
        for callback in trainer.callbacks:
            if isinstance(callback, ModelCheckpoint | EarlyStopping) and callback.monitor == self.metric:
                callback.stop_monitoring()
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


class _CachedStateKey:
    """Lightning formats a callback's state key on every hook call (it names the profiler region);
    these callbacks' keys never change after construction, so compute them once."""

    _cached_state_key: str | None = None

    @property
    def state_key(self) -> str:
        if self._cached_state_key is None:
            self._cached_state_key = super().state_key  # type: ignore[misc]
        return self._cached_state_key


class ModelCheckpoint(_CachedStateKey, pl.callbacks.ModelCheckpoint):
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.monitor is None and self.save_top_k == 1:
            self.save_top_k = 0
        self._pending_removals: list[str] = []

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Lightning removes the previous best right after saving the new one, while last.ckpt (what a
        restart resumes from) still names the previous best as the run's best: a kill before last.ckpt is
        saved again would leave it naming a checkpoint that is gone. The removal waits until last.ckpt is
        up to date, at the end of the same hook (`_removals_done`)."""
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
        if (
            self.monitor is not None
            and self.save_top_k != 0
            and self.monitor not in monitor_candidates
            and trainer.fit_loop.epoch_loop.val_loop._has_run
        ):
            raise MonitoredMetricMissing(self.monitor, monitor_candidates)
        super()._save_topk_checkpoint(trainer, monitor_candidates)


class EarlyStopping(_CachedStateKey, pl.callbacks.EarlyStopping):
    """Lightning's EarlyStopping; a monitored metric that is missing is one sentence. With no monitored
    metric (`monitor: null`, or a model that logs none) it never stops a run."""

    def stop_monitoring(self) -> None:
        self.monitor = None  # type: ignore[assignment]

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        if self.monitor is not None:
            super()._run_early_stopping_check(trainer)

    def _validate_condition_metric(self, logs: dict[str, Any]) -> bool:
        if self.strict and self.monitor not in logs:
            if not logs:
                return (
                    False  # nothing logged at all: MonitoredMetric decides (it stops monitoring or refuses)
                )
            raise MonitoredMetricMissing(self.monitor, logs)
        return super()._validate_condition_metric(logs)


class SharedRunDirCheck(Callback):
    """When fit starts on several nodes, check that every rank writes to the same, shared run dir: a
    node-local log dir would leave checkpoints where a requeued job, or another node, cannot find them."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            check_run_dir_is_shared(self.run_dir, trainer.num_nodes)


class AttemptProgress(Callback):
    """Rank 0 records this attempt's progress in run.yaml (`attempts`): when training started, the last
    checkpoint saved (timed by the checkpoint writer), a sign of life every `attempts.HEARTBEAT_S`. With
    requeue on, it warns once when the slowest save plus the wait for the next signal check does not fit
    in `requeue.signal_lead_s`, the time the signal comes before the time limit."""

    def __init__(self, signal_lead_s: float | None = None, signal_name: str = "SIGUSR1") -> None:
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
            attempts.record(trained_from={"at": round(time.time(), 3), "step": trainer.global_step})
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

    def on_validation_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._progress(trainer)

    def on_test_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._progress(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._progress(trainer)

    def _progress(self, trainer: Trainer) -> None:
        if not trainer.is_global_zero:
            return
        # the writer's record of its newest save (an FSDP2 strategy that writes its own shards may keep one)
        strategy = trainer.strategy
        save = getattr(strategy, "last_save", None) or getattr(strategy.checkpoint_io, "last_save", None)
        if save is not None and save is not self._seen_save:
            self._seen_save = save
            self._slowest_save_s = max(self._slowest_save_s, save.seconds)
            attempts.record(
                saved={
                    "at": round(save.at, 3),
                    "step": save.step,
                    "path": save.path,
                    "seconds": round(save.seconds, 3),
                }
            )
            self._check_signal_lead(trainer)
        if time.monotonic() >= self._beat_at:
            attempts.record(seen={"at": round(time.time(), 3), "step": trainer.global_step})
            self._beat_at = time.monotonic() + attempts.HEARTBEAT_S

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


class RankWatchdog(Callback):
    """Starts `hpctrain.runtime.distributed.watchdog` once the process group exists; Lightning's exception path (which
    ends local child ranks itself) is an orderly stop, not a rank failure. It tells the watchdog where this
    rank is within its step (two plain assignments per step), for the sentence that names a rank that
    does not arrive at a collective, and gives the process group `dist.timeout_min` once the first step
    is done (until then `dist.init_timeout_min`, as torchtitan does: startup can take much longer).

    Under DDP it also looks after streams (IterableDatasets), which Lightning does not share out
    across ranks: one warning for a stream that does not share itself out, and an end to the job,
    naming the rank, when the ranks' training data runs out after different numbers of batches.
    """

    def __init__(
        self,
        timeout_min: float = 30,
        init_timeout_min: float | None = None,
        straggler_every_s: float = 30,
        straggler_factor: float = 1.5,
    ) -> None:
        self.timeout_s = 60 * float(timeout_min)  # dist.timeout_min: how long ranks wait for each other
        self.straggler_every_s = float(straggler_every_s)
        self.straggler_factor = float(straggler_factor)
        self.clock = StepClock()
        self.report: StragglerReport | None = None
        self._logged: dict[int, float] | None = None
        self.timeout_min = float(timeout_min)
        self.init_timeout_min = self.timeout_min if init_timeout_min is None else float(init_timeout_min)
        self._training_timeout: float | None = None
        self._several = False
        self._batch_started = 0.0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        watchdog.start()
        signals.arm()  # a stop signal no batch follows for the grace period ends the run (StopGuard)
        if failures.state().children:  # rank 0 of the local launcher: its children are the watchdog's now
            launch.leave_children_to_the_watchdog()
        self._several = trainer.world_size > 1
        failures.set_timeout_min(self.init_timeout_min)
        if self._several and self.init_timeout_min != self.timeout_min:
            self._training_timeout = self.timeout_min
        if self._several and stage == "fit":
            every = self.straggler_every_s
            self.report = (
                StragglerReport(trainer.world_size, every, self.straggler_factor)
                if trainer.is_global_zero
                else None
            )
            positions.watch_steps(self.clock, self.report)
        if stage == "fit":
            positions.follow(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        signals.arm(False)
        positions.follow(None)
        positions.watch_steps(None, self.report)  # the clock stops; rank 0's totals stay for outcome.yaml

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self._several and trainer.is_global_zero):
            return
        loaders = trainer.train_dataloader
        for loader in loaders.values() if isinstance(loaders, dict) else _as_list(loaders):
            dataset = getattr(loader, "dataset", None)
            if dataset is not None and not shares_itself_out(dataset):
                log.warning(
                    "the training set %s is an IterableDataset, which Lightning does not share out across "
                    "ranks: each of the %d ranks reads all of it, the same samples; wrap it in "
                    "hpctrain.data.iterable.ShardedIterable, or share it out yourself (stream_share()) and set "
                    "`shards_across_ranks = True` on its class",
                    type(dataset).__name__,
                    trainer.world_size,
                )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_started = time.perf_counter()
        if self._several:
            positions.note_phase(0)
            self.clock.step_started()

    def _progressed(self, *args: Any, **kwargs: Any) -> None:
        """A validation, test or predict batch completed: the run moves (signals.StopGuard)."""
        signals.progressed()

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _progressed

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self._several:
            positions.note_phase(1)
            self.clock.backward_started()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.clock.epoch_ended()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._several:
            positions.publish_timing()  # complete figures for outcome.yaml

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.clock.step_ended()
        positions.note_phase(0)  # before the next step's backward pass, whatever hook it stalls in first
        signals.progressed(time.perf_counter() - self._batch_started)
        if self._training_timeout is not None:  # the first step is done: from now on, dist.timeout_min
            _set_timeout(self._training_timeout, mesh_groups(trainer))
            self._training_timeout = None
        report = self.report
        if report is not None and report.latest and report.latest is not self._logged:
            # the ranks' own time per step of the last window, at the straggler check's low rate
            self._logged = report.latest
            pl_module.log_dict(
                {f"ranks/own_ms/{r}": v for r, v in report.latest.items()}, rank_zero_only=True
            )
        if self._several and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            positions.note_training_data_end(
                trainer.current_epoch,
                trainer.fit_loop.epoch_loop.batch_progress.current.ready,
                trainer.world_size,
                self.timeout_s,
            )

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        failures.note_failure(exception)  # now, while the other ranks can still be told
        watchdog.stop()


def mesh_groups(trainer: Trainer) -> list[Any]:
    """The process groups of the strategy's device mesh (FSDP2, tensor parallelism), if it has one."""
    mesh = getattr(trainer.strategy, "_device_mesh", None)
    return list(mesh.get_all_groups()) if mesh is not None else []


def _set_timeout(minutes: float, groups: list[Any] | None = None) -> None:
    """The process group was made with dist.init_timeout_min (startup: data preparation, the first
    compilation); once a step has run, its collectives get dist.timeout_min: the default group's and the
    device mesh's `groups` (which torch creates with its own default, 10 minutes on NCCL)."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # public in later torch; torch 2.6, the oldest of the window, has only the private name
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        for group in [None, *(groups or [])]:
            set_timeout(timedelta(minutes=minutes), group=group)
    failures.set_timeout_min(minutes)


def _as_list(loaders: Any) -> list[Any]:
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def check_run_dir_is_shared(run_dir: str | Path, num_nodes: int) -> None:
    """Every rank of a multi-node job must write to rank 0's run dir and see the run.yaml rank 0 wrote.

    Call it on every rank once the process group exists. The verdicts are gathered, so every rank
    stops with the same sentence (none waits in a collective for a rank that already left).
    """
    import socket

    import torch.distributed as dist

    if num_nodes <= 1 or not (dist.is_available() and dist.is_initialized()):
        return
    run_dir = Path(run_dir).resolve()
    expected = [str(run_dir)]
    dist.broadcast_object_list(expected, src=0)
    where = f"rank {dist.get_rank()} on {socket.gethostname()}"
    problem = ""
    if str(run_dir) != expected[0]:
        problem = (
            f"{where} uses the run dir {run_dir} but rank 0 uses {expected[0]}; set paths.log_dir to one "
            "directory on a filesystem every node mounts (not a node-local path such as $TMPDIR)."
        )
    elif not (run_dir / "run.yaml").is_file():
        problem = (
            f"{where} cannot see {run_dir}/run.yaml, which rank 0 wrote: the run dir is not on a filesystem "
            "every node mounts; set paths.log_dir to a shared directory."
        )
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    first = next((v for v in verdicts if v), None)
    if first:
        raise UserError(first)
