"""Experiment loggers that a requeued or resumed run continues instead of replacing, and what they are
told about the job that ran.

The run dir is the run's identity (under SLURM it is keyed by the job id), so every logger writes
into it with a fixed name and version: a restarted job appends to the same metrics.csv, the same
TensorBoard directory, the same MLflow run and the same W&B run.

Besides the config, every logger gets `job_metadata` as the `job` params (csv's hparams.yaml, TensorBoard's
hparams, MLflow's params, W&B's config): the Slurm job and array ids, the allocation, the code (git
commit, dirty flag, snapshot digest) and hpctrain's version; MLflow also as tags (`tag_runs`).
"""

from __future__ import annotations

import csv
import hashlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.loggers.logger import rank_zero_experiment  # namespace-free: rank 0 or not
from torchvision.utils import save_image

from hpctrain.runtime import namespaces
from hpctrain.runtime.environment import allocated, launched
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.storage.records import read_run_record


def job_metadata(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What ran this run: the same for every attempt of a requeued run (an MLflow param cannot change),
    so the code is the one run.yaml recorded first."""
    code = read_run_record(run_dir).get("git") or {}
    snapshot = code.get("snapshot")
    return {
        **launched.slurm_ids(),
        "allocation": allocated.allocation(),  # nodes, tasks per node, GPUs, ... as SLURM granted them
        "git_commit": code.get("commit"),
        "git_dirty": code.get("dirty"),
        "code_snapshot": Path(snapshot).name if snapshot else None,  # logs/snapshots/<digest>
        "code_diff_sha256": code.get("diff_sha256"),
        # hpctrain's package, initialised before any of its modules; importing it here would close a
        # circle of imports through hpctrain.load
        "hpctrain_version": sys.modules["hpctrain"].__version__,
    }


def tag_runs(loggers: list[Any], metadata: dict[str, Any]) -> None:
    """MLflow runs get `metadata` as tags too (searchable, shown in a run's overview; a tag, unlike a param,
    may change), and the commit where MLflow's UI looks for it."""
    tags = {key: str(value) for key, value in _flat(metadata).items() if value is not None}
    if metadata.get("git_commit"):
        tags["mlflow.source.git.commit"] = str(metadata["git_commit"])
    for logger in loggers:
        namespace = namespaces.namespace_of(logger)
        mlflow_class = namespace.get("pytorch_lightning.loggers.MLFlowLogger") if namespace else None
        if mlflow_class is not None and isinstance(logger, mlflow_class) and tags:
            from mlflow.entities import RunTag

            logger.experiment.log_batch(logger.run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def _flat(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def stable_run_key(run_dir: str | os.PathLike[str]) -> str:
    """A short id derived from the run dir: the same for a requeued job, different for every other run."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


class _AppendingWriter(LightningPart, lightning="pytorch_lightning.loggers.csv_logs.ExperimentWriter"):
    """Lightning's CSV writer deletes an existing metrics.csv; this one keeps it and appends. It takes
    TensorBoard's `add_image` too (Lightning's GAN example logs its samples so), as
    <run dir>/images/<tag>/<step>.png; TensorBoard's other `add_*` are one sentence."""

    def add_image(
        self, tag: str, img_tensor: Any, global_step: int | None = None, dataformats: str = "CHW", **_: Any
    ) -> None:
        image = torch.as_tensor(img_tensor).detach().cpu()
        if dataformats in ("HWC", "HW"):
            image = image.permute(2, 0, 1) if dataformats == "HWC" else image[None]
        image = image.float() / 255 if not image.is_floating_point() else image
        path = Path(self.log_dir, "images", re.sub(r"\W+", "_", tag).strip("_") or "image")
        path.mkdir(parents=True, exist_ok=True)
        save_image(image, path / f"{global_step or 0:06d}.png")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("add_"):
            raise UserError(
                f"logger.experiment.{name}(...) is TensorBoard's, and the csv logger keeps metrics and images "
                "(add_image) only; log it with logger=tensorboard (or logger=many: csv and tensorboard)."
            )
        raise AttributeError(name)

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])


class ResumableCSVLogger(LightningPart, lightning="pytorch_lightning.loggers.CSVLogger"):
    """Writes metrics.csv (and hparams.yaml) directly in `save_dir`, appending on resume."""

    def __init__(self, save_dir: str, flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(
            save_dir=save_dir, name="", version="", flush_logs_every_n_steps=flush_logs_every_n_steps
        )

    @property
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = self.namespace.part(_AppendingWriter)(log_dir=self.log_dir)
        return self._experiment


def mlflow_logger(tracking_uri: str, experiment_name: str, run_dir: str, tags: Any = None, **kwargs: Any):
    """An MLFlowLogger whose run is found again by a tag holding the run dir's key.

    Only global rank 0 touches the tracking store: creating a client opens it, and ranks of a
    multi-node job that open a fresh SQLite store together race to create its tables (and fail). The
    other ranks get no MLflow logger (None, left out of the trainer's loggers): they would log nothing.
    """
    if not launched.is_rank_zero():
        return None
    import mlflow

    key = stable_run_key(run_dir)
    client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    run_id = None
    if experiment is not None:
        runs = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.run_key = '{key}'", max_results=1
        )
        run_id = runs[0].info.run_id if runs else None
    labels = dict(tags) if isinstance(tags, dict) else {str(tag): "true" for tag in tags or []}
    kwargs.setdefault("run_name", Path(run_dir).name)
    return namespaces.current().get("pytorch_lightning.loggers.MLFlowLogger")(  # the run's namespace's
        experiment_name=experiment_name,
        tracking_uri=tracking_uri,
        run_id=run_id,
        tags={"run_key": key, "run_dir": str(run_dir), **labels},
        **kwargs,
    )


def wandb_logger(save_dir: str, run_dir: str, **kwargs: Any):
    """A WandbLogger whose id is derived from the run dir, so a requeued job resumes the same run."""
    kwargs.setdefault("id", stable_run_key(run_dir))
    kwargs.setdefault("resume", "allow")
    return namespaces.current().get("pytorch_lightning.loggers.WandbLogger")(save_dir=save_dir, **kwargs)
