"""The run dir: resume-point selection, the run record, and logs that a restarted run appends to."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hpctrain import outputs
from hpctrain.errors import UserError
from hpctrain.loggers import ResumableCSVLogger, stable_run_key
from tests.helpers import read_metrics


def _ckpt(run_dir: Path, name: str, age_s: float = 0) -> Path:
    path = run_dir / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_a_run_dir_with_a_checkpoint_resumes_from_its_own_newest(tmp_path: Path):
    run = tmp_path / "runs" / "slurm-7"
    _ckpt(run, "last.ckpt", age_s=60)
    requeue = _ckpt(run, "requeue.ckpt")
    other = _ckpt(tmp_path / "runs" / "slurm-8", "requeue.ckpt", age_s=-60)  # newer, but another job's
    assert outputs.checkpoint_to_resume(None, run, tmp_path / "runs") == requeue
    assert outputs.checkpoint_to_resume(str(other), run, tmp_path / "runs") == requeue


def test_a_fresh_run_starts_cleanly_or_from_what_it_was_given(tmp_path: Path):
    runs = tmp_path / "runs"
    fresh = runs / "new"
    assert outputs.checkpoint_to_resume(None, fresh, runs) is None
    with pytest.raises(UserError, match="ckpt_path=last but no earlier run"):
        outputs.checkpoint_to_resume("last", fresh, runs)
    _ckpt(runs / "a", "last.ckpt", age_s=100)
    newest = _ckpt(runs / "b", "last.ckpt", age_s=10)
    assert outputs.checkpoint_to_resume("last", fresh, runs) == newest
    assert outputs.checkpoint_to_resume(str(newest), fresh, runs) == newest
    with pytest.raises(UserError, match="does not exist"):
        outputs.checkpoint_to_resume(str(tmp_path / "missing.ckpt"), fresh, runs)


def test_run_record_keeps_every_attempt(tmp_path: Path):
    cfg = OmegaConf.create({"seed": 1, "model": {"lr": "${seed}"}})
    for _ in range(2):
        outputs.write_run_record(cfg, tmp_path, ["seed=1"], tmp_path, world_size=4)
    record = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert len(record["attempts"]) == 2 and record["attempts"][0]["world_size"] == 4
    assert record["overrides"] == ["seed=1"] and "torch" in record["versions"]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"seed": 1, "model": {"lr": 1}}


def test_csv_logger_appends_when_a_run_continues(tmp_path: Path):
    first = ResumableCSVLogger(str(tmp_path))
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.save()
    second = ResumableCSVLogger(str(tmp_path))  # the requeued job, same run dir
    second.log_metrics({"train/loss": 0.5, "val/acc": 0.9}, step=1)
    second.save()
    rows = read_metrics(tmp_path)
    assert [r["train/loss"] for r in rows] == ["1.0", "0.5"] and rows[1]["val/acc"] == "0.9"


def test_logger_ids_follow_the_run_dir(tmp_path: Path):
    assert stable_run_key(tmp_path / "slurm-7") == stable_run_key(tmp_path / "slurm-7")
    assert stable_run_key(tmp_path / "slurm-7") != stable_run_key(tmp_path / "slurm-8")
