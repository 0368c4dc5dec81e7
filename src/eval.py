"""Test a checkpoint: python src/eval.py ckpt_path=<path/to/file.ckpt> [key=value ...]

The model config comes from the checkpoint (the weights define the architecture), and so does the
data config unless you choose one (data=... or data.<key>=...).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # `python src/eval.py` works without `pip install -e .`

from hpctrain import signals  # noqa: E402

signals.install_early()  # SLURM's signals are recorded from the first moment (by default they kill)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from hpctrain import cluster, command_line, console, outputs, watchdog  # noqa: E402
from hpctrain.config_checks import check_config  # noqa: E402
from hpctrain.errors import reported_as_one_sentence  # noqa: E402

command_line.install("eval")  # composition mistakes as one sentence; --help lists the groups once


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> dict[str, float]:
    with reported_as_one_sentence(), watchdog.failures_reported():
        if cluster.launcher() == cluster.CHILD:
            watchdog.die_with_parent()
        check_config(cfg)
        signals.install(cfg.requeue.signal if cfg.requeue.enabled else None)
        checkpoint = outputs.existing_checkpoint(cfg.get("ckpt_path"))
        cluster.preflight(cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.accelerator)
        hydra_cfg = HydraConfig.get()
        run_dir, overrides = hydra_cfg.runtime.output_dir, outputs.task_overrides(hydra_cfg)
        if cluster.is_rank_zero():
            outputs.check_writable(run_dir)

        from hpctrain import build, checkpointing, launch
        from hpctrain.evaluation import config_from_checkpoint
        from hpctrain.requeue import Interrupted, requeue_and_wait

        cfg = config_from_checkpoint(cfg, checkpoint, overrides)
        check_config(cfg)
        console.apply_extras(cfg)
        build.configure_process(cfg)
        run = build.run_objects(cfg, run_dir, training=False)
        checkpointing.check_matches_model(checkpoint, run.model)
        if cluster.is_rank_zero():
            outputs.write_run_record(cfg, run_dir, overrides, ROOT, run.trainer.world_size, hydra_cfg)
            console.warn_if_bf16_is_emulated(run.trainer, cfg.trainer.precision)
        completed = False
        try:
            run.trainer.test(run.model, run.datamodule, ckpt_path=str(checkpoint), weights_only=True)
            completed = True
            return console.report(run_dir, run.trainer, None)
        except Interrupted as interrupted:
            requeue_and_wait(interrupted)  # under SLURM the job is requeued and tests again
            return {}
        finally:
            launch.end_distributed_job(run.trainer, completed)


if __name__ == "__main__":
    main()
    watchdog.exit_if_finished_worker()  # ranks > 0 skip the C++ destructors that can abort at exit
