"""Turn the composed config into the objects Lightning runs: datamodule, model, callbacks, loggers, trainer.

Besides what the config names, the trainer always gets:
- the cluster environment chosen by `hpctrain.cluster` (SLURM without Lightning's auto-requeue);
- `HydraDDPStrategy` for `strategy: ddp` (or `auto` with more than one process), with the
  collective timeout from `dist.timeout_min`;
- `CheckpointExtras`, so checkpoints resume exactly and eval can rebuild the model; `CheckpointOnSignal` when `requeue.enabled`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.loggers import Logger

from hpctrain import cluster
from hpctrain.checkpointing import CheckpointExtras
from hpctrain.launch import HydraDDPStrategy
from hpctrain.outputs import REQUEUE_CHECKPOINT, checkpoint_dir
from hpctrain.requeue import CheckpointOnSignal


def seed_everything(seed: int) -> None:
    """Seed torch, numpy, python and (through PL_SEED_WORKERS) every dataloader worker."""
    pl.seed_everything(seed, workers=True, verbose=False)


def datamodule(cfg: DictConfig) -> LightningDataModule:
    return instantiate(cfg.data)


def model(cfg: DictConfig) -> LightningModule:
    return instantiate(cfg.model)


def _instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every non-null entry of a group like `callbacks` or `logger`."""
    if not group:
        return []
    return [instantiate(entry) for entry in group.values() if entry is not None and "_target_" in entry]


def loggers(cfg: DictConfig) -> list[Logger]:
    return _instantiate_group(cfg.get("logger"))


def callbacks(cfg: DictConfig, run_dir: str | Path, has_logger: bool) -> list[Callback]:
    chosen = _instantiate_group(cfg.get("callbacks"))
    if not has_logger:
        chosen = [c for c in chosen if not isinstance(c, LearningRateMonitor)]
    stored = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "data") if k in cfg}
    chosen.append(CheckpointExtras(stored, run_dir))
    requeue = cfg.get("requeue")
    if requeue is not None and requeue.enabled:
        chosen.append(
            CheckpointOnSignal(
                checkpoint_dir(run_dir) / REQUEUE_CHECKPOINT,
                requeue_signal=requeue.signal,
                check_every_n_steps=requeue.check_every_n_steps,
            )
        )
    return chosen


def _processes(trainer_cfg: DictConfig) -> int | None:
    try:
        return int(trainer_cfg.num_nodes) * int(trainer_cfg.devices)
    except (TypeError, ValueError):
        return None


def strategy(trainer_cfg: DictConfig, dist_cfg: DictConfig | None) -> Any:
    chosen = trainer_cfg.get("strategy", "auto")
    if not (chosen == "ddp" or (chosen == "auto" and _processes(trainer_cfg) not in (None, 1))):
        return chosen
    dist_cfg = dist_cfg or OmegaConf.create({})
    return HydraDDPStrategy(
        process_group_backend=dist_cfg.get("backend"),
        timeout=timedelta(minutes=float(dist_cfg.get("timeout_min", 30))),
    )


def trainer(cfg: DictConfig, run_dir: str | Path, **overrides: Any) -> Trainer:
    """The Trainer for `cfg.trainer`; keyword arguments replace config entries (e.g. logger=False)."""
    precision = cfg.get("extras", {}).get("float32_matmul_precision")
    if precision:
        torch.set_float32_matmul_precision(precision)
    chosen_loggers = overrides.pop("logger", None)
    if chosen_loggers is None:
        chosen_loggers = loggers(cfg)
    kwargs: dict[str, Any] = {
        "logger": chosen_loggers or False,
        "callbacks": callbacks(cfg, run_dir, has_logger=bool(chosen_loggers)),
        "strategy": strategy(cfg.trainer, cfg.get("dist")),
        "plugins": [cluster.lightning_cluster_environment()],
    }
    kwargs.update(overrides)
    return instantiate(cfg.trainer, **kwargs)


def log_hyperparameters(trainer: Trainer, cfg: DictConfig) -> None:
    """Send the resolved config to every logger (rank 0)."""
    if not trainer.loggers:
        return
    params = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(params, dict)
    params["num_processes"] = trainer.world_size
    for logger in trainer.loggers:
        logger.log_hyperparams(params)


def best_checkpoint(trainer: Trainer) -> str | None:
    """The best checkpoint of this fit, if a ModelCheckpoint saved one."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, "best_model_path", "") if callback is not None else ""
    return path if path and os.path.isfile(path) else None
