"""The run dir: what a run leaves behind, and which checkpoint a (re)started run continues from.

    <run dir>/config.yaml          the resolved config
    <run dir>/run.yaml             command, overrides, git commit, package versions, one entry per attempt
    <run dir>/metrics.csv          the csv logger's metrics
    <run dir>/checkpoints/         last.ckpt, the best epoch_NNN.ckpt, requeue.ckpt after a preemption
    <run dir>/.hydra/              Hydra's own record of the composition

Only global rank 0 writes here. No torch import: this runs before the heavy imports.
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from hpctrain import cluster
from hpctrain.errors import UserError

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
REQUEUE_CHECKPOINT = "requeue.ckpt"
RESUMABLE = (REQUEUE_CHECKPOINT, LAST_CHECKPOINT)
RECORDED_PACKAGES = (
    "torch",
    "torchvision",
    "pytorch-lightning",
    "torchmetrics",
    "hydra-core",
    "omegaconf",
    "hpctrain",
)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newer of requeue.ckpt and last.ckpt in this run dir, if any."""
    found = [p for name in RESUMABLE if (p := checkpoint_dir(run_dir) / name).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def checkpoint_to_resume(ckpt_path: str | None, run_dir: str | Path, runs_root: str | Path) -> Path | None:
    """What `trainer.fit` starts from.

    1. This run dir's own newest checkpoint: the run dir is keyed by the SLURM job id, so this is a
       requeued job continuing (and a fresh job can never pick up another job's checkpoint).
    2. `ckpt_path=last`: the newest last.ckpt / requeue.ckpt of this task's earlier runs.
    3. `ckpt_path=<file>`.
    """
    own = newest_checkpoint(run_dir)
    if own is not None:
        return own
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        here = Path(run_dir).resolve()
        candidates = [
            p
            for name in RESUMABLE
            for p in Path(runs_root).glob(f"*/{CHECKPOINT_DIR}/{name}")
            if p.parent.parent.resolve() != here
        ]
        if not candidates:
            raise UserError(
                f"ckpt_path=last but no earlier run under {runs_root} has a last.ckpt; "
                "train once without ckpt_path, or pass ckpt_path=<path/to/file.ckpt>."
            )
        return max(candidates, key=lambda p: p.stat().st_mtime)
    return existing_checkpoint(ckpt_path)


def existing_checkpoint(ckpt_path: str | None) -> Path:
    if ckpt_path in (None, "", "null"):
        raise UserError("ckpt_path is required: pass ckpt_path=<path/to/file.ckpt>.")
    path = Path(str(ckpt_path)).expanduser()
    if not path.is_file():
        raise UserError(
            f"ckpt_path={ckpt_path} does not exist; pass the path of a .ckpt file (see <run dir>/checkpoints/)."
        )
    return path


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def write_run_record(
    cfg: DictConfig, run_dir: str | Path, overrides: list[str], project_root: str | Path, world_size: int
) -> None:
    """Write config.yaml (once) and add this attempt to run.yaml. Call on global rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.yaml"
    if not config_file.exists():
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))

    record_file = run_dir / "run.yaml"
    record: dict[str, Any] = yaml.safe_load(record_file.read_text()) if record_file.exists() else {}
    root = Path(project_root)
    commit = _git(["rev-parse", "HEAD"], root)
    record.setdefault("command", shlex.join([Path(sys.argv[0]).name, *overrides]))
    record.setdefault("overrides", list(overrides))
    record.setdefault(
        "git", {"commit": commit, "dirty": bool(_git(["status", "--porcelain"], root)) if commit else None}
    )
    record.setdefault("versions", _versions())
    record.setdefault("attempts", []).append(
        {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(),
            "launcher": cluster.launcher(),
            "world_size": world_size,
            "slurm_job_id": cluster.slurm_job_id(),
            "slurm_restart_count": cluster.restart_count(),
        }
    )
    tmp = record_file.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(record, sort_keys=False))
    tmp.replace(record_file)
