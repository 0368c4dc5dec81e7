"""Train a model: python src/train.py [experiment=...] [group=option ...] [key=value ...]

compose config -> preflight checks -> build data, model, trainer -> fit -> test -> report.
Nothing heavy is imported until the checks pass, so `--help`, `--cfg job` and every config or
launch mistake answer in well under a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # `python src/train.py` works without `pip install -e .`

from hpctrain import signals  # noqa: E402

signals.install_early()  # SLURM's signals are recorded from the first moment (by default they kill)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from hpctrain import cluster, command_line, console, outputs, watchdog  # noqa: E402
from hpctrain.config_checks import check_config  # noqa: E402
from hpctrain.errors import reported_as_one_sentence  # noqa: E402
from hpctrain.sweeps.jobs import in_multirun, run_job  # noqa: E402

command_line.install("train")  # composition mistakes as one sentence; --help lists the groups once


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_job(train, cfg)  # in a sweep (-m), a failed job is recorded and the sweep goes on


def train(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    metric = cfg.monitor.metric if "monitor" in cfg else None
    overrides = outputs.task_overrides(hydra_cfg)
    # outcome.yaml, read by sweep summaries
    recorded = outputs.outcome_recorded(run_dir, metric, overrides, in_sweep=in_multirun())
    with reported_as_one_sentence(), watchdog.failures_reported(), recorded as outcome:
        # 1. Preflight: config types, launcher vs trainer topology, the run dir and where to start. No torch yet.
        if cluster.launcher() == cluster.CHILD:
            watchdog.die_with_parent()
        check_config(cfg)
        signals.install(cfg.requeue.signal if cfg.requeue.enabled else None)  # recorded, acted on below
        cluster.preflight(
            cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.accelerator, cfg.requeue.enabled
        )
        if cluster.is_rank_zero():
            outputs.check_writable(run_dir)
        start = outputs.start_point(cfg.ckpt_path, run_dir, cfg.paths.runs_dir)
        console.apply_extras(cfg)

        # 2. Build: data (checked on every rank before any process group), model, callbacks, loggers, trainer.
        from hpctrain import build, checkpointing, launch
        from hpctrain.requeue import Interrupted, requeue_and_wait

        build.configure_process(cfg)
        run = build.run_objects(cfg, run_dir)
        resume_note = None
        if start.checkpoint is not None:
            checkpointing.check_matches_model(start.checkpoint, run.model)
            resume_note = checkpointing.resume_overrides(
                start.checkpoint, OmegaConf.to_container(cfg.model, resolve=True)
            )
        if cluster.is_rank_zero():
            outputs.write_run_record(cfg, run_dir, overrides, ROOT, run.trainer.world_size, hydra_cfg)
            outputs.remove_partial_saves(run_dir)
            build.log_hyperparameters(run.trainer, cfg)
            console.warn_if_bf16_is_emulated(run.trainer, cfg.trainer.precision)
            console.log.info(start.describe())
            if resume_note:
                console.log.warning(resume_note)
            if run.trainer.world_size > 1:
                console.log.info(cluster.network_summary(run.trainer.num_nodes))

        completed = False
        try:
            # 3. Fit (from the start point), then test the best checkpoint. A signal stops either at a
            #    point every rank agrees on (hpctrain.requeue).
            if cfg.train:
                run.trainer.fit(run.model, run.datamodule, ckpt_path=start.checkpoint, weights_only=True)
                if run.preemption is not None:
                    run.preemption.after_fit(run.trainer)
            best = build.best_checkpoint(run.trainer)
            if cfg.test and build.can_test(run.model, run.datamodule):
                run.trainer.test(run.model, run.datamodule, ckpt_path=best, weights_only=True)

            # 4. Report where everything went; sweepers get the best value of `monitor.metric`.
            console.report(run_dir, run.trainer, best)
            completed = True
            outcome.value = run.monitor.best if run.monitor is not None else None
            return outcome.value
        except Interrupted as interrupted:
            requeue_and_wait(interrupted)  # SLURM requeues the job and ends every rank; SIGTERM: exit 143
            return None
        finally:
            launch.end_distributed_job(run.trainer, completed)


if __name__ == "__main__":
    main()
    watchdog.exit_if_finished_worker()  # ranks > 0 skip the C++ destructors that can abort at exit
