"""Train a model: python src/train.py [experiment=...] [group=option ...] [key=value ...]

compose config -> preflight checks -> build data, model, trainer -> fit -> test -> report.
Nothing heavy is imported until the checks pass, so `--help`, `--cfg job` and every config or
launch mistake answer in well under a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # `python src/train.py` works without `pip install -e .`

from hpctrain import cluster, console, outputs  # noqa: E402
from hpctrain.config_checks import check_config  # noqa: E402
from hpctrain.errors import hydra_errors_as_one_sentence, reported_as_one_sentence  # noqa: E402

hydra_errors_as_one_sentence("train")


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with reported_as_one_sentence():
        # 1. Preflight: config types, launcher vs trainer topology, the run dir and where to start. No torch yet.
        check_config(cfg)
        cluster.preflight(
            cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.accelerator, cfg.requeue.enabled
        )
        run_dir = HydraConfig.get().runtime.output_dir
        if cluster.is_rank_zero():
            outputs.check_writable(run_dir)
        start = outputs.start_point(cfg.ckpt_path, run_dir, cfg.paths.runs_dir)
        console.apply_extras(cfg)

        # 2. Build: data (checked on every rank before any process group), model, callbacks, loggers, trainer.
        from hpctrain import build, checkpointing, launch
        from hpctrain.requeue import TrainingInterrupted, requeue_and_wait

        build.configure_process(cfg)
        run = build.run_objects(cfg, run_dir)
        if start.checkpoint is not None:
            checkpointing.check_matches_model(start.checkpoint, run.model)
        if cluster.is_rank_zero():
            hydra_cfg = HydraConfig.get()
            outputs.write_run_record(
                cfg, run_dir, list(hydra_cfg.overrides.task), ROOT, run.trainer.world_size, hydra_cfg
            )
            build.log_hyperparameters(run.trainer, cfg)
            console.log.info(start.describe())

        try:
            # 3. Fit (from the start point), then test the best checkpoint.
            if cfg.train:
                run.trainer.fit(run.model, run.datamodule, ckpt_path=start.checkpoint, weights_only=True)
            best = build.best_checkpoint(run.trainer)
            if cfg.test:
                run.trainer.test(run.model, run.datamodule, ckpt_path=best, weights_only=True)

            # 4. Report where everything went; sweepers get the best value of `monitor.metric`.
            console.report(run_dir, run.trainer, best)
            return run.monitor.best if run.monitor is not None else None
        except TrainingInterrupted as interrupted:
            requeue_and_wait(interrupted)  # rank 0 requeues the SLURM job, which then ends every rank
            return None
        finally:
            launch.end_distributed_job(run.trainer)


if __name__ == "__main__":
    main()
