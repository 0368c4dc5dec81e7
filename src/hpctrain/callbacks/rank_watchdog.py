"""`RankWatchdog`: the rank watchdog, the stop guard, where each rank is, collective timeouts, streams."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from hpctrain.data.iterable import shares_itself_out
from hpctrain.runtime.distributed import failures, launch, positions, signals, watchdog
from hpctrain.runtime.distributed.stragglers import StepClock, StragglerReport
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.run")


class RankWatchdog(LightningPart, lightning="pytorch_lightning.Callback"):
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
        self.straggler_every_s = float(straggler_every_s)
        self.straggler_factor = float(straggler_factor)
        self.clock = StepClock()
        self.report: StragglerReport | None = None
        self._logged: dict[int, float] | None = None
        self.timeout_min = float(timeout_min)  # dist.timeout_min: how long ranks wait for each other
        self.init_timeout_min = self.timeout_min if init_timeout_min is None else float(init_timeout_min)
        self._training_timeout: float | bool | None = None  # False: set once a step was done
        self._several = False
        self._batch_started = 0.0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        watchdog.start()
        signals.arm()  # a stop signal no batch follows for the grace period ends the run (StopGuard)
        if failures.state().children:  # rank 0 of the local launcher: its children are the watchdog's now
            launch.leave_children_to_the_watchdog()
        self._several = trainer.world_size > 1
        if self._training_timeout is not False:  # not the test after fit, whose steps are done
            starting = self._several and self.init_timeout_min != self.timeout_min
            self._training_timeout = self.timeout_min if starting else None
            failures.set_timeout_min(self.init_timeout_min, f"dist.{'init_' if starting else ''}timeout_min")
        if self._several and stage == "fit":
            every = self.straggler_every_s
            self.report = (
                StragglerReport(trainer.world_size, every, self.straggler_factor)
                if trainer.is_global_zero
                else None
            )
            positions.watch_steps(self.clock, self.report)
        positions.follow(trainer)  # from the first collective: the sanity check, evaluation, test, predict

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
        if self._training_timeout:  # the first step is done: from now on, dist.timeout_min
            _set_timeout(self._training_timeout, mesh_groups(trainer))
            self._training_timeout = False
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
                60 * self.timeout_min,
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
    if dist.is_available() and dist.is_initialized():
        # public in later torch; torch 2.6, the oldest of the window, has only the private name
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        for group in [None, *(groups or [])]:
            set_timeout(timedelta(minutes=minutes), group=group)
    failures.set_timeout_min(minutes)


def _as_list(loaders: Any) -> list[Any]:
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
