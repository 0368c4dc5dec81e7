"""One job's lifecycle, the same for every entry point (train, eval, export): preflight, build, run, end.

    with Job(cfg) as job:                  # preflight: config, launcher vs trainer, run dir; no torch yet
        run = job.build()                  # data, model, callbacks, loggers, trainer; the run's record
        with job.running(run):             # a signal: checkpoint, requeue (or stop); always: teardown
            ...                            # fit, test
            return job.finish(run)

A job without a trainer (export: one process, no fit or test) writes the same record with `job.record()`.
The job keeps one config, `job.cfg`: eval and predict replace it once with the checkpoint's model and
data (`job.from_checkpoint`).
How the job ends is recorded once, in <run dir>/outcome.yaml (read by sweep summaries), and said
once: a mistake as one sentence and exit status 2 (`errors`), a rank's crash as one line naming it
(`watchdog`), a signal by requeueing the SLURM job or exiting with 143 (`requeue`).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpctrain.runtime import confined, run_state
from hpctrain.runtime.config.checks import check_config, check_hydra_env
from hpctrain.runtime.config.compose import CODE_ROOT, searchpath_overrides, task_overrides
from hpctrain.runtime.config.settings import Settings, Sources
from hpctrain.runtime.distributed import (
    failures,
    flight_recorder,
    notify,
    positions,
    signals,
    stacks,
    watchdog,
)
from hpctrain.runtime.distributed.requeue import requeue_and_wait
from hpctrain.runtime.environment import allocated, launch_checks, launched, network
from hpctrain.runtime.errors import UserError, reported_as_one_sentence
from hpctrain.runtime.report import console
from hpctrain.runtime.storage import attempts, records
from hpctrain.runtime.storage.checkpoints import newest_checkpoint

if TYPE_CHECKING:
    from hpctrain.runtime.run.build import Run

log = logging.getLogger("hpctrain")


class Job:
    def __init__(self, cfg: DictConfig, one_process: bool = False) -> None:
        self.cfg = cfg
        self.one_process = one_process  # export: more than one process is refused in preflight
        self.hydra_cfg = HydraConfig.get()
        self.run_dir = Path(self.hydra_cfg.runtime.output_dir)
        self.overrides = task_overrides(self.hydra_cfg)
        # what chose the configs (and so the code) on the command line: what a reader composes a checkpoint with
        self.chosen = [*searchpath_overrides(self.hydra_cfg), *self.overrides]
        self.sweep = in_multirun() or launched.array_task()[1] is not None  # a point of a sweep
        self.outcome: records.Outcome | None = None
        self.checkpoint: Path | None = None  # the trained checkpoint an eval or predict job starts from
        self.where = Sources(self.hydra_cfg, self.overrides)  # which file set a key, for its sentence
        self.settings: Settings = self._notify_alone()  # hpctrain's own, typed: checked in the preflight
        self._stack = ExitStack()

    def __enter__(self) -> Job:
        # This job's state (signals, failures, notifications, the watchdog, ...: `run_state`), fresh
        # even when an earlier job of a sweep ran in this process. Its end is the stack's last step, after
        # the outcome and the notification, so everything above still reads this job's; the sweep
        # (`run_job`) and `entry.end` read the ended job's state after it, until the next job begins.
        run_state.begin()
        self._stack.callback(run_state.end)
        if in_multirun():
            failures.in_sweep()  # a failure ends this job, not the sweep's process
        self._stack.enter_context(reported_as_one_sentence())
        self._stack.enter_context(watchdog.failures_reported())
        self.outcome = self._stack.enter_context(
            records.outcome_recorded(self.run_dir, None, self.overrides, in_sweep=in_multirun())
        )
        self.outcome.signature = records.config_signature(self.cfg)
        self._stack.enter_context(attempts.attempt_recorded(self.run_dir, self.outcome))  # run.yaml, cost
        self._stack.enter_context(self._ending_posted())
        try:
            self._preflight()
        except BaseException:
            if not self._stack.__exit__(*sys.exc_info()):
                raise
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._stack.__exit__(*exc):
            return True
        if exc[0] is None:  # done and recorded: a late time-limit signal no longer fails the job
            signals.completed()
        # A point of a packed job saved for the requeue, recorded as requeued: it ends here (status 0),
        # and its pack's driver requeues the allocation (requeue.requeue_and_wait).
        stopped = exc[1]
        return (
            isinstance(stopped, signals.Interrupted) and stopped.requeue and launched.pack_point() is not None
        )

    @contextmanager
    def _ending_posted(self) -> Iterator[None]:
        """Notifications (`notify`) set up on every rank; rank 0 posts how the job ended (a crash: the rank
        that reports it)."""
        # the defaults until the preflight has checked the config's (`_preflight`): a refusal is posted too
        self._configure_notify()
        ended: BaseException | None = None
        try:
            yield
        except BaseException as err:
            ended = err
            raise
        finally:
            if launched.is_rank_zero() and self.outcome is not None:
                notify.job_ended(ended, self.outcome.metric, self.outcome.value, self.outcome.test)

    def _preflight(self) -> None:
        """Everything that can be checked before torch is imported: one sentence and exit 2 on a mistake."""
        cfg = self.cfg
        if launched.launcher() == launched.CHILD:
            failures.die_with_parent()
        settings = self.settings = check_config(cfg, self.where)  # hpctrain's own keys, typed from here on
        self._configure_notify()
        if self.outcome is not None and settings.monitor is not None:
            self.outcome.metric = settings.monitor.metric
        check_hydra_env(self.hydra_cfg, settings.notify.url_env)
        if self.sweep:  # a job array's task (a sweep launched in-process is checked in run_job)
            check_sweep_has_a_metric(settings)
        requeue = settings.requeue
        # recorded, acted on later; a stop nothing answers ends the run after requeue.stop_grace_s
        signals.install(requeue.signal if requeue.enabled else None, requeue.stop_grace_s)
        keys = settings.trainer
        if self.one_process:
            launch_checks.preflight_one_process(cfg.task_name, keys.num_nodes, keys.devices)
        launch_checks.preflight(
            keys.num_nodes, keys.devices, keys.accelerator, requeue.enabled, backend=settings.dist.backend
        )
        chosen = network.settle_gloo_interface(keys.num_nodes)  # gloo's side groups
        if chosen and launched.is_rank_zero():
            log.info(chosen)
        confined.check_no_links_out(self.run_dir)  # a received run dir continued in place: its own files only
        if launched.is_rank_zero():
            records.check_writable(self.run_dir)

    def _notify_alone(self) -> Settings:
        """Until the preflight has checked the whole config: the defaults with the config's `notify`
        section, where that section holds by itself (a refusal of another key is posted where the user
        asked), else the defaults."""
        if "notify" not in self.cfg:
            return Settings()
        try:
            return Settings.of(OmegaConf.masked_copy(self.cfg, ["notify"]), self.where)
        except (UserError, OmegaConfBaseException):
            return Settings()

    def _configure_notify(self) -> None:
        notify.configure(self.settings.notify, self.run_dir, self.hydra_cfg.mode == RunMode.MULTIRUN)

    def from_checkpoint(self, checkpoint: Path) -> DictConfig:
        """The job's config from now on: the model, data and monitor this project composes from what the
        checkpoint proposes (its options and values; the command line wins), checked again (eval, predict,
        export)."""
        from hpctrain.runtime.storage.checkpoints import reading

        cfg = self.cfg = reading.config_from_checkpoint(self.cfg, checkpoint, self.chosen)
        self.settings = check_config(cfg, self.where)
        self.checkpoint = checkpoint
        if self.outcome is not None and self.settings.monitor is not None:
            self.outcome.metric = self.settings.monitor.metric  # the one the checkpoint was trained with
        return cfg

    def build(self, training: bool = True) -> Run:
        """The run's objects (torch from here on), and on rank 0 its record in the run dir."""
        from hpctrain.runtime.run import build

        cfg = self.cfg
        stacks_signal = self.settings.diagnostics.stacks_signal
        if stacks_signal:  # scripts/stacks.py: where every rank is, from now on, even when it hangs
            stacks.register(self.run_dir, stacks_signal)
        keys = self.settings.trainer
        if keys.accelerator in allocated.GPU_ACCELERATORS or flight_recorder.recording():
            network.flight_recorder_dumps_into(self.run_dir)  # the record of the collectives of a hang
        console.apply_extras(cfg, self.settings.extras)
        if not training:
            console.quiet_training_callbacks()
        build.configure_process(cfg, self.settings)
        checkpoint = None
        if self.checkpoint is not None:  # weights of another model: one sentence before anything takes memory
            from hpctrain.runtime.storage.checkpoints import reading

            checkpoint = build.Checkpoint(self.checkpoint, reading.read(self.checkpoint, weights=False))
        run = build.run_objects(cfg, self.settings, self.run_dir, training, self.sweep, checkpoint)
        if launched.is_rank_zero():
            cpus = allocated.cpus_per_process(keys.devices, accelerator=keys.accelerator)[0]
            devices = attempts.devices_of(type(run.trainer.accelerator).__name__, cpus)
            self._write_record(cfg, run.trainer.world_size, devices)
            if training:
                build.log_hyperparameters(run.trainer, cfg)
            console.warn_if_bf16_is_emulated(run.trainer, keys.precision)
            if run.trainer.world_size > 1:
                console.log.info(network.network_summary(run.trainer.num_nodes))
        return run

    def record(self) -> None:
        """What `build` does for a job without a trainer (one process): the config printed if `extras`
        asks, and the run's record (config.yaml, run.yaml, .hydra/) written."""
        console.apply_extras(self.cfg, self.settings.extras)
        self._write_record(self.cfg, 1, attempts.devices_of("cpu", allocated.cpus_per_process(1)[0]))

    def _write_record(self, cfg: DictConfig, world_size: int, devices: dict[str, Any]) -> None:
        records.write_run_record(cfg, self.run_dir, self.overrides, CODE_ROOT, world_size, self.hydra_cfg)
        attempts.begin(self.run_dir, devices)

    @contextmanager
    def running(self, run: Run) -> Iterator[None]:
        """Around fit and test: on a recorded signal, requeue (SLURM) or stop (exit 143), or, when the
        requeue budget is spent, stop with its sentence (`attempts`); then end the process group and the
        local ranks, in order, however the block ended."""
        from hpctrain.runtime.distributed import launch

        completed = False
        try:
            yield
            completed = True
        except signals.Interrupted as interrupted:
            step, saved = run.trainer.global_step, interrupted.checkpoint
            attempts.note_end(step, saved)
            if interrupted.requeue:
                last = saved or newest_checkpoint(self.run_dir)
                attempts.stop_if_budget_spent(self.settings.requeue, self.run_dir, step, last)
                attempts.record_requeue(step, saved)
            requeue_and_wait(interrupted)  # SLURM requeues the job and ends every rank; SIGTERM: exit 143
        finally:
            attempts.note_end(run.trainer.global_step, None)
            if self.outcome is not None and run.monitor is not None:
                # the best value so far, however the block ended (a test that failed after fit, too)
                self.outcome.metric, self.outcome.value = run.monitor.metric, run.best_value
            launch.end_distributed_job(run.trainer, completed)

    def finish(self, run: Run, best: str | None = None) -> dict[str, float]:
        """Report where everything went and record the run's outcome; return the run's scalar metrics by
        name (Lightning's callback metrics: the test results after a test). A sweeper's value is not
        among them: it is the best of `monitor.metric` (`run.best_value`, which src/train.py returns)."""
        from hpctrain.callbacks.performance_log import PerformanceLog  # torch is imported by now

        results = console.report(self.run_dir, run.trainer, best)
        if self.outcome is not None:
            self.outcome.ranks = positions.rank_summary()  # each rank's time per step, under DDP
            self.outcome.performance = next(
                (c.summary for c in run.trainer.callbacks if isinstance(c, PerformanceLog)), None
            )
            self.outcome.skipped_files = getattr(run.datamodule, "skipped_files", None)  # data.skip_bad=true
            self.outcome.test = {k: v for k, v in results.items() if k.startswith("test")} or None
        return results


# ------------------------------------------------------------------- a job of a sweep (-m)


@dataclass
class Skipped:
    """The jobs of the current sweep skipped by skip_completed=true, reported when it ends: the sweep's, not
    a job's (`run_state.sweep_part`; the sweep's summary callback begins and ends it)."""

    jobs: list[int] = field(default_factory=list)


def skipped() -> list[int]:
    """The current sweep's skipped jobs (add to it; `hpctrain.runtime.sweeps.summary` reports it)."""
    return run_state.sweep_part(Skipped).jobs


def in_multirun() -> bool:
    """Whether this process runs the jobs of a sweep (not a DDP child rank started by one of them)."""
    return HydraConfig.get().mode == RunMode.MULTIRUN and launched.launcher() != launched.CHILD


def check_sweep_has_a_metric(settings: Settings) -> None:
    if settings.train and settings.monitor is not None and settings.monitor.metric is None:
        raise UserError(
            "monitor.metric=null, but a sweep compares its points by the monitored metric; pass "
            "monitor.metric=<a metric the model logs> (and monitor.mode=min or max)."
        )


def run_job(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Run `task(cfg)`. In a sweep, a job that fails (its one-sentence error, or a crash of any of its
    ranks) returns None instead of ending the sweep: its run dir's outcome.yaml says why, and the
    sweep's summary.csv lists it. Outside a sweep, failures end the process as usual."""
    if not in_multirun():
        return task(cfg)
    if launched.launcher() == launched.TORCHRUN:
        raise UserError(
            "a sweep (-m) under torchrun would run every point in every worker; run the sweep without "
            "torchrun (DDP with trainer.devices, Lightning starts the local ranks), as SLURM jobs "
            "(hydra/launcher=slurm), or one torchrun command per point."
        )
    job = HydraConfig.get().job.num
    try:
        settings = Settings.of(cfg)  # the sweep's point, checked again by its job's preflight
    except UserError:
        settings = None  # this point's own mistake: its job's preflight says it, and the sweep goes on
    if settings is not None:
        check_sweep_has_a_metric(settings)  # before the first point: the whole sweep is refused
    if settings is not None and settings.skip_completed:
        run_dir = HydraConfig.get().runtime.output_dir
        done = records.completed_with(run_dir, records.config_signature(cfg))
        if done is not None:  # the same config completed in this job's dir: its result stands
            skipped().append(job)
            log.info("job %s: already completed in %s with the same config; skipped", job, run_dir)
            return done.get("value")
    try:
        return task(cfg)
    except SystemExit as err:
        if err.code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            raise  # the sweep itself was told to stop
        if err.code not in (0, None):
            log.error("job %s failed (exit status %s); the sweep goes on", job, err.code)
        return None
    except KeyboardInterrupt:
        if failures.take_verdict() is None:
            raise  # Ctrl-C: stop the sweep
        log.error("job %s failed (one of its ranks died); the sweep goes on", job)
        return None
    except Exception as err:
        log.error("job %s failed (%s); the sweep goes on", job, type(err).__name__)
        return None
