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
from hpctrain.errors import reported_as_one_sentence  # noqa: E402
from hpctrain.resolvers import register_resolvers  # noqa: E402

register_resolvers(ROOT)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with reported_as_one_sentence():
        # 1. Preflight: config types, launcher vs trainer topology, resume point. No torch yet.
        check_config(cfg)
        cluster.preflight(
            cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.accelerator, cfg.requeue.enabled
        )
        run_dir = HydraConfig.get().runtime.output_dir
        resume_from = outputs.checkpoint_to_resume(cfg.ckpt_path, run_dir, cfg.paths.runs_dir)
        console.apply_extras(cfg)

        # 2. Build: data (checked on every rank before any process group), model, trainer.
        from hpctrain import build, launch
        from hpctrain.requeue import TrainingInterrupted, finish

        build.seed_everything(cfg.seed)
        datamodule = build.datamodule(cfg)
        datamodule.check_available()
        model = build.model(cfg)
        trainer = build.trainer(cfg, run_dir)
        if cluster.is_rank_zero():
            outputs.write_run_record(
                cfg, run_dir, list(HydraConfig.get().overrides.task), ROOT, trainer.world_size
            )
            build.log_hyperparameters(trainer, cfg)

        try:
            # 3. Fit (resuming if this job was requeued, or from ckpt_path), then test the best checkpoint.
            if cfg.train:
                if resume_from is not None and cluster.is_rank_zero():
                    console.log.info("resuming from %s", resume_from)
                trainer.fit(model, datamodule, ckpt_path=resume_from, weights_only=True)
            best = build.best_checkpoint(trainer)
            if cfg.test:
                trainer.test(model, datamodule, ckpt_path=best, weights_only=True)

            # 4. Report where everything went.
            metrics = console.report(run_dir, trainer, best)
            return metrics.get(cfg.get("optimized_metric") or "")
        except TrainingInterrupted as interrupted:
            finish(interrupted)  # rank 0 requeues the SLURM job, which then ends every rank
            return None
        finally:
            launch.end_distributed_job(trainer)


if __name__ == "__main__":
    main()
