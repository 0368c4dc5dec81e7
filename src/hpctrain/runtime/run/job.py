"""One job's lifecycle, the same for every entry point (train, eval, predict, export), in one function,
`job`, read top to bottom:

    start      the job's state begins (fresh after an earlier job of a sweep in this process); from here
               a mistake is one sentence and exit status 2, a rank's crash one line naming it, and how the
               job ends is recorded (outcome.yaml, this attempt in run.yaml) and posted (the webhook); the
               preflight checks the config, the launcher against the trainer and the run dir (a reader
               first composes what its checkpoint proposes), before torch is imported
    success    recorded as completed; a time-limit signal that comes later no longer fails the job
    a signal   the run stopped where every rank agreed, its checkpoint saved (`requeue`): SLURM requeues the
               job and every rank waits to be ended (or, the requeue budget spent, it stops in one
               sentence); SIGTERM or Ctrl-C exits 143 or 130; a point of a packed job ends here, recorded
               as requeued, and its entry point returns its Outcome
    a failure  recorded and said once, then raised on
    always     the run's process group and local ranks ended; the job's state closed

    with job(cfg) as current:          # start
        run = current.build()          # data, model, callbacks, loggers, trainer; the run's record
        ...                            # fit, test
        current.finish(run)            # the report
    return current.outcome             # completed, or stopped on a signal

A job without a trainer (export: one process, no fit or test) writes the same record with `current.record()`.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from hpctrain.runtime.config.settings import Notify, Settings, Sources
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
from hpctrain.runtime.storage.checkpoints import existing_checkpoint, newest_checkpoint

if TYPE_CHECKING:
    from hpctrain.runtime.run.build import Run

log = logging.getLogger("hpctrain")


@contextmanager
def job(cfg: DictConfig, one_process: bool = False, reader: bool = False) -> Iterator[Job]:
    """The lifecycle (see the module docstring). `one_process`: more than one process is refused (export);
    `reader`: the job reads a checkpoint (`ckpt_path`), whose proposal its model and data come from."""
    current = Job(cfg, one_process)
    run_state.begin()
    try:
        with (
            reported_as_one_sentence(),
            watchdog.failures_reported(),
            records.outcome_recorded(
                current.run_dir, None, current.overrides, in_multirun()
            ) as current.outcome,
            attempts.recorded(current.run_dir, current.outcome) as current.attempt,
            current.ending_posted(),
        ):
            current.preflight(reader)
            completed = False
            try:
                yield current
                completed = True
            except signals.Interrupted as stopped:
                current.stop(stopped)  # requeue or exit; a packed point's stop is raised on, to end here
            finally:
                current.end_run(completed)
    except signals.Interrupted as stopped:
        if not (stopped.requeue and launched.pack_point() is not None):
            raise
        # a point of a packed job, saved and recorded as requeued: it ends here (status 0), and its pack's
        # driver requeues the allocation (requeue.requeue_and_wait)
    else:
        signals.completed()  # done and recorded: a late time-limit signal no longer fails the job
    finally:
        run_state.end()


class Job:
    """One job: its config, its run dir, its settings (checked once, in the preflight), its records and the
    run it builds."""

    def __init__(self, cfg: DictConfig, one_process: bool = False) -> None:
        self.cfg = cfg
        self.one_process = one_process  # export: more than one process is refused in preflight
        self.hydra_cfg = HydraConfig.get()
        self.run_dir = Path(self.hydra_cfg.runtime.output_dir)
        self.overrides = task_overrides(self.hydra_cfg)
        # what chose the configs (and so the code) on the command line: what a reader composes a checkpoint with
        self.chosen = [*searchpath_overrides(self.hydra_cfg), *self.overrides]
        self.sweep = in_multirun() or launched.array_task()[1] is not None  # a point of a sweep
        self.where = Sources(self.hydra_cfg, self.overrides)  # which file set a key, for its sentence
        self.settings: Settings  # hpctrain's own, typed: set once, as the preflight ends
        self.checkpoint: Path | None = None  # the checkpoint a reader (eval, predict, export) starts from
        self.options: dict[str, str] = {}  # the options a reader's model and data were composed with
        self.outcome: records.Outcome | None = None  # how the job ended, as outcome.yaml records it
        self.attempt: attempts.Attempt | None = None  # this process's attempt, as run.yaml records it
        self.run: Run | None = None  # what `build` built

    @contextmanager
    def ending_posted(self) -> Iterator[None]:
        """Notifications (`notify`) set up on every rank; rank 0 posts how the job ended (a crash: the rank
        that reports it). Until the preflight has checked the config, its `notify` section where that
        holds by itself: a refusal of another key is posted where the user asked."""
        notify.configure(
            _notify_alone(self.cfg, self.where), self.run_dir, self.hydra_cfg.mode == RunMode.MULTIRUN
        )
        ended: BaseException | None = None
        try:
            yield
        except BaseException as err:
            ended = err
            raise
        finally:
            if launched.is_rank_zero() and self.outcome is not None:
                notify.job_ended(ended, self.outcome.metric, self.outcome.value, self.outcome.test)

    def preflight(self, reader: bool = False) -> None:
        """Everything that can be checked before torch is imported: one sentence and exit 2 on a mistake.
        Then a reader's checkpoint: the model, data and monitor this project composes from what it proposes
        (torch reads it), checked again."""
        if launched.launcher() == launched.CHILD:
            failures.die_with_parent()
        if in_multirun():
            failures.in_sweep()  # a failure ends this job, not the sweep's process
        cfg = self.cfg
        settings = check_config(cfg, self.where)  # hpctrain's own keys, typed
        notify.configure(settings.notify, self.run_dir, self.hydra_cfg.mode == RunMode.MULTIRUN)
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
        if reader:  # only the model, data and monitor differ: the sections used above are the same
            from hpctrain.runtime.storage.checkpoints import reading

            self.checkpoint = existing_checkpoint(settings.ckpt_path)
            self.cfg, self.options = reading.config_from_checkpoint(cfg, self.checkpoint, self.chosen)
            settings = check_config(self.cfg, self.where)
        self.settings = settings  # final: what the job and its run use from here on
        assert self.outcome is not None
        self.outcome.signature = records.config_signature(self.cfg)
        if self.settings.monitor is not None:
            self.outcome.metric = self.settings.monitor.metric

    def build(self, training: bool = True) -> Run:
        """The run's objects (torch from here on), and on rank 0 its record in the run dir."""
        from hpctrain.runtime.run import build

        cfg, settings = self.cfg, self.settings
        if settings.diagnostics.stacks_signal:  # scripts/stacks.py: where every rank is, even when it hangs
            stacks.register(self.run_dir, settings.diagnostics.stacks_signal)
        keys = settings.trainer
        if keys.accelerator in allocated.GPU_ACCELERATORS or flight_recorder.recording():
            network.flight_recorder_dumps_into(self.run_dir)  # the record of the collectives of a hang
        console.apply_extras(cfg, settings.extras, self.options)
        if not training:
            console.quiet_training_callbacks()
        build.configure_process(settings, cfg.data)
        checkpoint = None
        if self.checkpoint is not None:  # weights of another model: one sentence before anything takes memory
            from hpctrain.runtime.storage.checkpoints import reading

            checkpoint = build.Checkpoint(self.checkpoint, reading.read(self.checkpoint, weights=False))
        run = self.run = build.run_objects(
            cfg, settings, self.run_dir, training, self.sweep, checkpoint, self.attempt
        )
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
        console.apply_extras(self.cfg, self.settings.extras, self.options)
        self._write_record(self.cfg, 1, attempts.devices_of("cpu", allocated.cpus_per_process(1)[0]))

    def _write_record(self, cfg: DictConfig, world_size: int, devices: dict[str, Any]) -> None:
        records.write_run_record(cfg, self.run_dir, self.overrides, CODE_ROOT, world_size, self.hydra_cfg)
        assert self.attempt is not None
        self.attempt.begin(devices)

    def stop(self, interrupted: signals.Interrupted) -> None:
        """On a recorded signal (the run stopped where every rank agreed): requeue (SLURM), or stop with
        the requeue budget's sentence (`attempts`), or exit (143 after SIGTERM)."""
        assert self.attempt is not None
        step, saved = (self.run.trainer.global_step if self.run else 0), interrupted.checkpoint
        self.attempt.note_end(step, saved)
        if interrupted.requeue:
            last = saved or newest_checkpoint(self.run_dir)
            attempts.stop_if_budget_spent(self.settings.requeue, self.attempt, step, last)
            self.attempt.record_requeue(step, saved)
        requeue_and_wait(interrupted)  # SLURM requeues the job and ends every rank; SIGTERM: exit 143

    def end_run(self, completed: bool) -> None:
        """However the job ended: the monitored metric's best so far recorded, then the process group and
        the local ranks ended, in order."""
        from hpctrain.runtime.distributed import launch

        if self.run is None:
            return
        if self.attempt is not None:
            self.attempt.note_end(self.run.trainer.global_step, None)
        if self.outcome is not None and self.run.monitor is not None:
            # the best value so far, however the job ended (a test that failed after fit, too)
            self.outcome.metric, self.outcome.value = self.run.monitor.metric, self.run.best_value
        launch.end_distributed_job(self.run.trainer, completed)

    def finish(self, run: Run, best: str | None = None) -> dict[str, float]:
        """Report where everything went and record the run's outcome; return the run's scalar metrics by
        name (Lightning's callback metrics: the test results after a test). A sweeper's value is not
        among them: it is the best of `monitor.metric` (the outcome's value)."""
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


def _notify_alone(cfg: DictConfig, where: Sources) -> Notify:
    """The config's `notify` section where it holds by itself, else the defaults."""
    if "notify" not in cfg:
        return Notify()
    try:
        return Settings.of(OmegaConf.masked_copy(cfg, ["notify"]), where).notify
    except (UserError, OmegaConfBaseException):
        return Notify()


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


def run_job(task: Callable[[DictConfig], records.Outcome], cfg: DictConfig) -> float | None:
    """Run `task(cfg)` and return what a sweeper compares: the best value of the monitored metric (its
    outcome's). In a sweep, a job that fails (its one-sentence error, or a crash of any of its ranks)
    returns None instead of ending the sweep: its run dir's outcome.yaml says why, and the sweep's
    summary.csv lists it. Outside a sweep, failures end the process as usual."""
    if not in_multirun():
        return task(cfg).value
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
        return task(cfg).value
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
