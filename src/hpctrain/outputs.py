"""The run dir: what a run leaves behind, and which checkpoint a (re)started run continues from.

    <run dir>/config.yaml          the resolved config
    <run dir>/run.yaml             command, overrides, git commit, package versions, one entry per attempt
    <run dir>/metrics.csv          the csv logger's metrics
    <run dir>/checkpoints/         last.ckpt, the best epoch_NNN.ckpt, requeue.ckpt after a preemption
    <run dir>/.hydra/              Hydra's record of the composition (written here, after the checks pass)

The run dir is the run's identity. Only global rank 0 writes here, and only after every check has
passed: a refused command leaves an existing run dir exactly as it was. No torch import.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
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
RECORDED_PACKAGES = ("torch", "torchvision", "pytorch-lightning", "torchmetrics", "hydra-core", "omegaconf")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newer of requeue.ckpt and last.ckpt in this run dir, if any."""
    found = [p for name in RESUMABLE if (p := checkpoint_dir(run_dir) / name).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_run_record(run_dir: str | Path) -> dict[str, Any]:
    record_file = Path(run_dir) / "run.yaml"
    if not record_file.is_file():
        return {}
    try:
        return yaml.safe_load(record_file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(
            f"{record_file} is not valid YAML ({err.__class__.__name__}); move the run dir aside."
        ) from err


def task_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's overrides as typed. Read without resolving: in Hydra's config an override such as
    `model.num_classes=${data.n_classes}` is a string OmegaConf would try to resolve there, and fail."""
    return [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]


@dataclass(frozen=True)
class StartPoint:
    checkpoint: Path | None
    reason: str

    def describe(self) -> str:
        return (
            f"starting from {self.checkpoint} ({self.reason})"
            if self.checkpoint
            else f"starting fresh ({self.reason})"
        )


def is_restart(record: Mapping[str, Any], env: Mapping[str, str] | None = None) -> bool:
    """Whether this process continues the run recorded in run.yaml: the same SLURM job, requeued, or
    the same torchrun run, restarted by its agent."""
    attempts = record.get("attempts") or []
    job = cluster.slurm_job_id(env)
    if job is not None and any(str(a.get("slurm_job_id")) == job for a in attempts):
        return True
    restarts = cluster.torchrun_restart_count(env)
    run = cluster.run_id(env)
    return restarts > 0 and any(a.get("run_id") == run for a in attempts)


def start_point(
    ckpt_path: str | None, run_dir: str | Path, runs_root: str | Path, env: Mapping[str, str] | None = None
) -> StartPoint:
    """What `trainer.fit` starts from; refuses, in one sentence, everything ambiguous.

    1. A restarted job (the same SLURM job id, requeued) continues from its run dir's newest checkpoint,
       whatever `ckpt_path` its first attempt was given.
    2. Otherwise a run dir that already holds checkpoints belongs to another run: it is refused, unless
       `ckpt_path` names one of those very checkpoints (continuing that run, in its dir, on purpose).
    3. `ckpt_path=last`: the newest last.ckpt / requeue.ckpt of this task's earlier runs.
    4. `ckpt_path=<file>`, which must exist; none: a fresh start.
    """
    run_dir = Path(run_dir)
    own = newest_checkpoint(run_dir)
    given = None if ckpt_path in (None, "", "null") else str(ckpt_path)
    if own is not None:
        record = read_run_record(run_dir)
        if is_restart(record, env):
            return StartPoint(
                own,
                f"restart {cluster.restart_count(env) or cluster.torchrun_restart_count(env)} of this job",
            )
        if given is not None and given != "last":
            path = existing_checkpoint(given)
            if path.resolve().parent == checkpoint_dir(run_dir).resolve():
                return StartPoint(path, f"ckpt_path={given}, in this run dir")
        previous = (record.get("attempts") or [{}])[-1]
        started = previous.get("started", "an earlier run")
        conflict = f"ckpt_path={given} conflicts with the" if given else "this run dir already holds"
        fresh = (
            "pass a new --rdzv-id to torchrun on every node (the run dir is named after it)"
            if cluster.launcher(env) == cluster.TORCHRUN
            else "start in a new run dir (drop the fixed hydra.run.dir)"
        )
        raise UserError(
            f"{conflict} checkpoints of another run in {run_dir} (started {started}); pass ckpt_path={own} "
            f"to continue that run there, or {fresh}."
        )
    if given is None:
        return StartPoint(None, "no checkpoint given")
    if given == "last":
        here = run_dir.resolve()
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
        return StartPoint(
            max(candidates, key=lambda p: p.stat().st_mtime), "ckpt_path=last: the newest earlier run"
        )
    return StartPoint(existing_checkpoint(given), f"ckpt_path={given}")


def existing_checkpoint(ckpt_path: str | None) -> Path:
    if ckpt_path in (None, "", "null"):
        raise UserError("ckpt_path is required: pass ckpt_path=<path/to/file.ckpt>.")
    path = Path(str(ckpt_path)).expanduser()
    if not path.is_file():
        raise UserError(
            f"ckpt_path={ckpt_path} does not exist; pass the path of a .ckpt file (see <run dir>/checkpoints/)."
        )
    return path


def remove_partial_saves(run_dir: str | Path) -> None:
    """Delete what checkpoint saves killed mid-write left behind (never a complete checkpoint)."""
    for leftover in checkpoint_dir(run_dir).glob(".*.ckpt.tmp-*"):
        leftover.unlink(missing_ok=True)


def check_writable(run_dir: str | Path) -> None:
    """Refuse a run dir this process cannot write (read-only filesystem, wrong owner, a file in the way)."""
    run_dir = Path(run_dir)
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"the run dir {run_dir} is not writable ({err.strerror or err}); set paths.log_dir to a directory "
            "you can write (on a cluster: one every node mounts)."
        ) from err


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _versions() -> dict[str, str]:
    from importlib import metadata  # here, not at the top: 5 ms that `--help` and `--cfg job` need not pay

    versions = {"python": platform.python_version()}
    for package in (*RECORDED_PACKAGES, __package__):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def write_run_record(
    cfg: DictConfig,
    run_dir: str | Path,
    overrides: list[str],
    project_root: str | Path,
    world_size: int,
    hydra_cfg: DictConfig | None = None,
) -> None:
    """Write config.yaml and Hydra's record (once) and add this attempt to run.yaml. Global rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.yaml"
    if not config_file.exists():
        _write_atomically(config_file, OmegaConf.to_yaml(cfg, resolve=True))
    hydra_dir = run_dir / ".hydra"
    if hydra_cfg is not None and not (hydra_dir / "config.yaml").exists():
        hydra_dir.mkdir(exist_ok=True)
        _write_atomically(hydra_dir / "config.yaml", OmegaConf.to_yaml(cfg))
        _write_atomically(hydra_dir / "overrides.yaml", yaml.safe_dump(list(overrides)))
        _write_atomically(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})))

    record = read_run_record(run_dir)
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
            "run_id": cluster.run_id(),
            "world_size": world_size,
            "slurm_job_id": cluster.slurm_job_id(),
            "slurm_restart_count": cluster.restart_count(),
            "slurm_log": cluster.slurm_output_file(),
        }
    )
    _write_atomically(run_dir / "run.yaml", yaml.safe_dump(record, sort_keys=False))


OUTCOME_FILE = "outcome.yaml"


@dataclass
class Outcome:
    """How a run ended, written to <run dir>/outcome.yaml by rank 0 (read by sweep summaries)."""

    metric: str | None = None
    value: float | None = None
    status: str = "running"
    error: str | None = None


@contextmanager
def outcome_recorded(
    run_dir: str | Path, metric: str | None, overrides: list[str] | None = None, in_sweep: bool = False
) -> Iterator[Outcome]:
    """Record in outcome.yaml how the block ended: completed (with `value`), failed (with the error's
    sentence), or stopped on a signal. Only where this run may write: a run dir that held no earlier
    run's record when it started (a refused command leaves an existing run dir untouched).

    A command refused before it started (a one-sentence error, outside a sweep) leaves no run dir:
    the sentence on the terminal is the whole record, and `logs/` keeps only runs that ran. In a sweep
    the refused job's outcome.yaml stays, for summary.csv."""
    run_dir = Path(run_dir)
    record_file = run_dir / "run.yaml"
    before = record_file.stat().st_mtime_ns if record_file.exists() else None
    outcome = Outcome(metric=metric)
    refused = False
    try:
        yield outcome
        outcome.status = "completed"
    except BaseException as err:
        outcome.status, outcome.error = _ending(err)
        refused = isinstance(err, UserError) and not record_file.exists()
        raise
    finally:
        # this run's dir: new when it started, or its run.yaml gained this attempt
        owned = before is None or (record_file.exists() and record_file.stat().st_mtime_ns != before)
        if refused and not in_sweep and cluster.is_rank_zero():
            _remove_if_only_logs(run_dir)
        elif owned and cluster.is_rank_zero() and run_dir.is_dir():
            record = {
                "status": outcome.status,
                "metric": outcome.metric,
                "value": outcome.value,
                "error": outcome.error,
                "overrides": list(overrides or []),
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            with suppress(OSError):  # an unwritable run dir has already been reported
                _write_atomically(run_dir / OUTCOME_FILE, yaml.safe_dump(record, sort_keys=False))


def _remove_if_only_logs(run_dir: Path) -> None:
    """Remove a run dir that holds nothing but Hydra's log file(s) of this refused start."""
    if not run_dir.is_dir() or any(p.suffix != ".log" or p.is_dir() for p in run_dir.iterdir()):
        return
    with suppress(OSError):
        for path in run_dir.iterdir():
            path.unlink()
        run_dir.rmdir()


def _ending(err: BaseException) -> tuple[str, str | None]:
    from hpctrain.signals import Interrupted

    if isinstance(err, Interrupted):
        return ("requeued" if getattr(err, "requeue", False) else "stopped"), str(err)
    if isinstance(err, SystemExit) and err.code in (0, None):
        return "completed", None
    text = str(err) if isinstance(err, UserError) else " ".join(f"{type(err).__name__}: {err}".split())
    return "failed", text[:500]


def read_outcome(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / OUTCOME_FILE
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
