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

import copy
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from hpctrain.runtime import confined, snapshot
from hpctrain.runtime.config import redact
from hpctrain.runtime.distributed import failures
from hpctrain.runtime.distributed.endings import REFUSED, ending
from hpctrain.runtime.distributed.stacks import STACKS_DIR
from hpctrain.runtime.environment import allocated, launched, slurm_job
from hpctrain.runtime.errors import UserError

RECORDED_PACKAGES = (
    "torch",
    "torchvision",
    "pytorch-lightning",
    "lightning",  # the same code, for classes written with `import lightning as L`
    "torchmetrics",
    "hydra-core",
    "omegaconf",
)


def read_run_record(run_dir: str | Path) -> dict[str, Any]:
    record_file = Path(run_dir) / "run.yaml"
    if not record_file.is_file():
        return {}
    try:
        record = confined.read_yaml(record_file, folder=run_dir) or {}
    except yaml.YAMLError as err:
        raise UserError(
            f"{record_file} is not valid YAML ({err.__class__.__name__}); move the run dir aside."
        ) from err
    attempts = record.get("attempts", []) if isinstance(record, dict) else None
    if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
        raise UserError(
            f"{record_file} is not a run's record (it holds a {type(record).__name__} where a mapping with a list "
            "of attempts should be); move the run dir aside, or start in a new run dir."
        )
    return record


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
    versions = {"python": platform.python_version()}
    for package in (*RECORDED_PACKAGES, __package__):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def code_record(root: Path) -> dict[str, Any]:
    """Which code runs: the commit and whether the working copy differed from it; from a snapshot taken
    at submission (hpctrain.runtime.snapshot), its manifest's commit, diff hash and path."""
    taken = snapshot.manifest(root)
    if taken is not None:
        return {
            "commit": taken.get("commit"),
            "dirty": taken.get("dirty"),
            "diff_sha256": taken.get("diff_sha256"),
            "snapshot": str(root),
        }
    commit = _git(["rev-parse", "HEAD"], root)
    return {"commit": commit, "dirty": bool(_git(["status", "--porcelain"], root)) if commit else None}


def write_run_record(
    cfg: DictConfig,
    run_dir: str | Path,
    overrides: list[str],
    code_root: str | Path,
    world_size: int,
    hydra_cfg: DictConfig | None = None,
) -> None:
    """Write config.yaml and Hydra's record (once) and add this attempt to run.yaml. Global rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.yaml"
    overrides = [redact.override(o) for o in overrides]  # no secret in any record (config.redact)
    if not config_file.exists():
        write_atomically(config_file, redact.yaml_text(cfg))
    hydra_dir = run_dir / ".hydra"
    if hydra_cfg is not None and not (hydra_dir / "config.yaml").exists():
        hydra_dir.mkdir(exist_ok=True)
        write_atomically(hydra_dir / "config.yaml", redact.yaml_text(cfg, resolve=False))
        write_atomically(hydra_dir / "overrides.yaml", yaml.safe_dump(overrides))
        hydra_record = OmegaConf.create({"hydra": hydra_cfg})
        write_atomically(hydra_dir / "hydra.yaml", redact.yaml_text(hydra_record, resolve=False))

    record = read_run_record(run_dir)
    record.setdefault("command", shlex.join([Path(sys.argv[0]).name, *overrides]))
    record.setdefault("overrides", overrides)
    record.setdefault("git", code_record(Path(code_root)))
    record.setdefault("versions", _versions())
    record.setdefault("attempts", []).append(
        {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(),
            "launcher": launched.launcher(),
            "run_id": launched.run_id(),
            "world_size": world_size,
            "slurm_job_id": launched.slurm_job_id(),
            "slurm_restart_count": launched.restart_count(),
            "slurm_log": slurm_job.slurm_output_file(),
            "slurm_allocation": allocated.allocation(),
        }
    )
    write_atomically(run_dir / "run.yaml", yaml.safe_dump(record, sort_keys=False))


OUTCOME_FILE = "outcome.yaml"


@dataclass
class Outcome:
    """How a run ended, written to <run dir>/outcome.yaml by rank 0 (read by sweep summaries)."""

    metric: str | None = None
    value: float | None = None
    status: str = "running"
    error: str | None = None
    ranks: dict[int, dict[str, Any]] | None = None  # per rank: its time per step, and where it went
    # data wait, step time, memory, FLOP/s: the job's, per rank, per node
    performance: dict[str, Any] | None = None
    signature: str | None = None  # of the composed config, without paths: a re-run sweep skips what matches
    skipped_files: int | None = None  # data.skip_bad=true: files left out as unreadable (rank 0's share)
    test: dict[str, float] | None = None  # the test metrics of a run that tested (sweep summaries group them)
    cost: dict[str, Any] | None = None  # device-hours per attempt and in total, work redone (`attempts`)


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
        if refused and not in_sweep and launched.is_rank_zero():
            _remove_if_only_logs(run_dir)
        elif owned and launched.is_rank_zero() and run_dir.is_dir():
            _write_outcome(run_dir, outcome, [redact.override(o) for o in overrides or []])


def record_lost(run_dir: str | Path, error: str) -> None:
    """outcome.yaml for a run whose processes ended without writing one (killed: out of memory, a signal
    that cannot be handled): failed, with what the process that started it saw (a packed job's driver)."""
    overrides = list(read_run_record(run_dir).get("overrides") or [])
    _write_outcome(Path(run_dir), Outcome(status="failed", error=error), overrides)


def _write_outcome(run_dir: Path, outcome: Outcome, overrides: list[str]) -> None:
    record = {
        "status": outcome.status,
        "metric": outcome.metric,
        "value": outcome.value,
        "error": outcome.error,
        "overrides": overrides,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for key in ("signature", "ranks", "performance", "skipped_files", "test", "cost"):
        if getattr(outcome, key):  # only what the run had
            record[key] = getattr(outcome, key)
    with suppress(OSError):  # an unwritable run dir has already been reported
        write_atomically(run_dir / OUTCOME_FILE, yaml.safe_dump(record, sort_keys=False))


UNSIGNED = ("paths", "hydra", "skip_completed", "snapshot")  # where a run writes, not what it computes


def config_signature(cfg: DictConfig) -> str | None:
    """A digest of the composed config without its paths: two runs with the same signature train the
    same thing (None if the config cannot be resolved here)."""

    # Every path is replaced by its name before resolving, so values built from paths (the data dir,
    # the checkpoint folder) sign the same wherever and whenever the run happens.
    placed = copy.deepcopy(cfg)
    with open_dict(placed):
        for key in list(placed.get("paths") or {}):
            placed.paths[key] = f"<paths.{key}>"
    try:
        content = OmegaConf.to_container(placed, resolve=True)
    except Exception:
        return None
    assert isinstance(content, dict)
    kept = {k: v for k, v in content.items() if k not in UNSIGNED}
    return hashlib.sha256(yaml.safe_dump(kept, sort_keys=True).encode()).hexdigest()[:16]


def completed_with(run_dir: str | Path, signature: str | None) -> dict[str, Any] | None:
    """The outcome of a run that completed in `run_dir` with this config signature, else None."""
    path = Path(run_dir) / OUTCOME_FILE
    if signature is None or not path.is_file():
        return None
    record = read_outcome(run_dir)
    return record if record.get("status") == "completed" and record.get("signature") == signature else None


def _remove_if_only_logs(run_dir: Path) -> None:
    """Remove a run dir that holds nothing but Hydra's log file(s) of this refused start (and the stacks
    folder each rank opens when it starts building)."""
    if not run_dir.is_dir():
        return
    entries = list(run_dir.iterdir())
    if any(
        not (p.suffix == ".log" and p.is_file()) and not (p.name == STACKS_DIR and p.is_dir())
        for p in entries
    ):
        return
    with suppress(OSError):
        for path in entries:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        run_dir.rmdir()


def _ending(err: BaseException) -> tuple[str, str | None]:
    if isinstance(err, KeyboardInterrupt) and failures.pending_verdict():  # a sweep job's rank died
        return "failed", failures.pending_verdict()
    found = ending(err)
    # outcome.yaml (and sweep summaries) keep their two words for a job that did not complete
    return ("failed" if found.status in (REFUSED, "exited") else found.status), found.detail


def read_outcome(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / OUTCOME_FILE
    try:
        outcome = confined.read_yaml(path, folder=run_dir) or {}
    except (OSError, yaml.YAMLError, UserError):  # a missing or unreadable record records nothing
        return {}
    return outcome if isinstance(outcome, dict) else {}  # a file of another shape records nothing
