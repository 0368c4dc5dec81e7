"""DDP on CPU (gloo) through `python src/train.py trainer=ddp_cpu`: Lightning starts the second process."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_ok, last_value, read_metrics, run_dirs, run_entry, train

pytestmark = pytest.mark.slow


def test_ddp_cpu_trains_two_gloo_processes_into_one_run_dir(tmp_path: Path):
    result = train(tmp_path, "trainer=ddp_cpu", "data=digits", "trainer.max_epochs=2")
    assert_ok(result)
    assert "processes: 2 (process group backend: gloo)" in result.stdout
    (run,) = run_dirs(tmp_path)  # one run dir for both ranks
    assert yaml.safe_load((run / "run.yaml").read_text())["attempts"][0]["world_size"] == 2
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and "last.ckpt" in checkpoints  # one set: best + last
    assert sorted(p.name for p in run.glob("*.log")) == ["train.log"]  # only rank 0 writes logs
    assert last_value(read_metrics(run), "test/acc") > 0.1


def test_test_metrics_count_every_sample_once(tmp_path: Path):
    """359 test digits split unevenly over 2 ranks give exactly the single-process numbers."""
    assert_ok(train(tmp_path, "trainer=cpu", "data=digits", "trainer.max_epochs=2", "test=false"))
    checkpoint = run_dirs(tmp_path)[0] / "checkpoints" / "last.ckpt"
    results = {}
    for trainer in ("cpu", "ddp_cpu"):
        log_dir = tmp_path / trainer
        assert_ok(
            run_entry("eval.py", f"paths.log_dir={log_dir}", f"ckpt_path={checkpoint}", f"trainer={trainer}")
        )
        rows = read_metrics(run_dirs(log_dir, task="eval")[0])
        results[trainer] = (last_value(rows, "test/acc"), last_value(rows, "test/loss"))
    assert results["ddp_cpu"][0] == results["cpu"][0]
    assert results["ddp_cpu"][1] == pytest.approx(results["cpu"][1], rel=1e-5)


def test_multirun_with_ddp_runs_each_job_once(tmp_path: Path):
    result = train(tmp_path, "-m", "trainer=ddp_cpu", "data=digits", "trainer.max_epochs=1", "seed=1,2")
    assert_ok(result)
    assert result.stdout.count("Launching 2 jobs locally") == 1  # the second ranks did not replay the sweep
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job in jobs:
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()
        assert yaml.safe_load((sweep / job / "run.yaml").read_text())["attempts"][0]["world_size"] == 2
    assert not (tmp_path / "train" / "runs").exists()  # children did not write elsewhere
    summary = (sweep / "summary.csv").read_text().splitlines()
    assert summary[0].startswith(
        "job,status,overrides,metric,value,run_dir,slurm_log,error,"
    )  # then groups, cost
    assert [line.split(",")[:3] for line in summary[1:]] == [
        ["0", "completed", "seed=1"],
        ["1", "completed", "seed=2"],
    ]
