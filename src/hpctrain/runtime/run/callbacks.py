"""The template's own callbacks, one function per concern, and the one order a run's callbacks take.

Each function takes the typed settings (and what its concern needs) and returns the callbacks it adds;
`ordered` puts them with the user's, in the order Lightning runs them, and says why. Built inside the
run's build (`hpctrain.runtime.run.build`): each is of the run's Lightning namespace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.callbacks.attempt_progress import AttemptProgress
from hpctrain.callbacks.batch_limits import BatchLimits
from hpctrain.callbacks.frozen_parts import FrozenParts
from hpctrain.callbacks.monitored_metric import MonitoredMetric, no_monitor_note
from hpctrain.callbacks.non_finite_loss import NonFiniteLoss
from hpctrain.callbacks.one_rank_calls import OneRankCalls
from hpctrain.callbacks.rank_watchdog import RankWatchdog
from hpctrain.callbacks.requeue_on_signal import RequeueOnSignal
from hpctrain.callbacks.resume_state import ResumeState
from hpctrain.callbacks.shared_run_dir_check import SharedRunDirCheck
from hpctrain.callbacks.trainable_only import TrainableOnly
from hpctrain.runtime.config.settings import InitFrom, Settings
from hpctrain.runtime.environment import launched
from hpctrain.runtime.storage.attempts import Attempt
from hpctrain.runtime.storage.checkpoints import REQUEUE_CHECKPOINT, checkpoint_dir

if TYPE_CHECKING:
    from pytorch_lightning import Callback, LightningModule

log = logging.getLogger("hpctrain")


@dataclass
class Own:
    """The template's callbacks of one run, by concern."""

    monitor: MonitoredMetric | None  # the best value of monitor.metric, returned to sweepers
    requeue: RequeueOnSignal | None  # checkpoints and stops where every rank agrees, on a signal
    others: list[Callback] = field(default_factory=list)


def template_callbacks(
    settings: Settings,
    run_dir: Path,
    training: bool,
    sweep: bool = False,
    stored: dict[str, Any] | None = None,
    attempt: Attempt | None = None,
    module: LightningModule | None = None,
) -> Own:
    """Every callback the template adds, concern by concern (`stored`: the config a checkpoint keeps;
    `module`: the model whose parameters `init_from.freeze` names)."""
    others = [
        *storing(settings),
        *guarding(settings, run_dir, training),
        BatchLimits(),  # a limit_*_batches fraction of a tiny split: one batch, not Lightning's refusal
        *(resuming(settings, run_dir, stored, attempt) if training else []),
        *(freezing(settings.init_from, module) if module is not None else []),
    ]
    return Own(monitoring(settings, training, sweep), requeueing(settings, run_dir), others)


def monitoring(settings: Settings, training: bool, sweep: bool) -> MonitoredMetric | None:
    """`monitor.metric` checked as soon as metrics exist and its best kept (training only)."""
    monitor = settings.monitor
    if not (training and monitor is not None and monitor.metric):
        if training and launched.is_rank_zero():
            log.info(no_monitor_note(None))
        return None
    return MonitoredMetric(monitor.metric, monitor.mode, sweep=sweep)


def requeueing(settings: Settings, run_dir: Path) -> RequeueOnSignal | None:
    """`requeue.enabled`: on the signal, a checkpoint where every rank agrees, then requeue or stop."""
    requeue = settings.requeue
    if not requeue.enabled:
        return None
    return RequeueOnSignal(
        checkpoint_dir(run_dir) / REQUEUE_CHECKPOINT,
        check_every_n_steps=requeue.check_every_n_steps,
        timeout_min=settings.dist.timeout_min,
    )


def storing(settings: Settings) -> list[Callback]:
    """`checkpoints.trainable_only`: how checkpoints store (and readers read) a frozen part."""
    return [TrainableOnly(settings.checkpoints.trainable_only)]


def guarding(settings: Settings, run_dir: Path, training: bool) -> list[Callback]:
    """A rank that dies, hangs or straggles named; a non-finite loss stops the run (`nan.action=stop`)."""
    dist, diagnostics = settings.dist, settings.diagnostics
    found: list[Callback] = [
        RankWatchdog(
            dist.timeout_min,
            dist.init_timeout_min,
            straggler_every_s=diagnostics.straggler_every_s,
            straggler_factor=diagnostics.straggler_factor,
        )
    ]
    if training and settings.nan.action == "stop":
        found.append(NonFiniteLoss(run_dir, settings.nan.check_every_n_steps))
    return found


def resuming(
    settings: Settings, run_dir: Path, stored: dict[str, Any] | None, attempt: Attempt | None
) -> list[Callback]:
    """What makes a resume exact and a checkpoint readable (the config it proposes), a run dir every node
    shares, and this attempt's progress in run.yaml (the save timed against `requeue.signal_lead_s`)."""
    requeue = settings.requeue
    progress = (
        AttemptProgress(attempt, requeue.signal_lead_s, requeue.signal)
        if requeue.enabled
        else AttemptProgress(attempt)
    )
    return [ResumeState(stored), SharedRunDirCheck(str(run_dir)), progress]


def freezing(init: InitFrom, module: LightningModule) -> list[Callback]:
    """`init_from.freeze`: the parameters it names frozen (until `init_from.unfreeze_at_epoch`)."""
    if not init.freeze:
        return []
    frozen = FrozenParts(module, list(init.freeze), init.unfreeze_at_epoch)
    if launched.is_rank_zero():
        until = f", until epoch {init.unfreeze_at_epoch}" if init.unfreeze_at_epoch is not None else ""
        log.info(
            "init_from.freeze: %d parameters frozen, %d BatchNorm layers fixed%s",
            len(frozen.frozen),
            len(frozen.norms),
            until,
        )
    return [frozen]


def sharding(settings: Settings, users: dict[str, Callback]) -> list[Callback]:
    """Under FSDP2, a callback of the user's that runs the model on one rank is one sentence."""
    if settings.trainer.strategy != "fsdp":
        return []
    return [OneRankCalls({id(callback): name for name, callback in users.items()})]


def ordered(users: dict[str, Callback], own: Own, settings: Settings) -> list[Callback]:
    """Every callback of the run, in the order Lightning runs them (list order, its own ModelCheckpoint
    last):

    1. the monitored metric: at each validation it decides whether the metric is logged and keeps its
       best before the checkpoint and early stopping callbacks look at it;
    2. the user's callbacks, as the config lists them;
    3. the template's, by concern (`template_callbacks`), and the FSDP2 guard over the user's;
    4. the requeue on a signal: its checkpoint is saved once every other callback has seen the step.
    """
    monitor = [own.monitor] if own.monitor is not None else []
    requeue = [own.requeue] if own.requeue is not None else []
    return [*monitor, *users.values(), *sharding(settings, users), *own.others, *requeue]
