"""The requeue budgets on the real two-node Slurm cluster: a job stops with one sentence instead of
requeueing when `requeue.max_attempts` is reached, or when an attempt got no further than the one before
it. Jobs are signalled with `scancel --signal=USR1`, as the time limit would, and requeued by scontrol."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.test_slurm import SBATCH_FILE, _output

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

ONE_TASK = ("--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=2G", "--gres=none")
HOLD = "+callbacks.hold._target_=tests.job_callbacks.HoldUntilSignalled"  # signalled when it says so


def _signal_when_held(cluster, out_dir: Path, job: str, restart: int, timeout_s: float = 120) -> None:
    """Send USR1 once attempt `restart` of the job holds at the start of fit (the batch script appends
    every attempt's output to one file)."""
    deadline = time.monotonic() + timeout_s
    while f"holding until signalled (restart {restart})" not in _output(out_dir, job):
        info = cluster.job(job)
        assert time.monotonic() < deadline, (info.get("JobState"), _output(out_dir, job)[-3000:])
        assert info.get("JobState") not in ("FAILED", "COMPLETED"), _output(out_dir, job)[-3000:]
        time.sleep(0.2)
    assert cluster.run("scancel", "--signal=USR1", job).returncode == 0


def test_requeue_budgets_stop_the_job_with_one_sentence(slurm_cluster, tmp_path: Path):
    """Two one-node jobs side by side. `requeue.max_attempts=1`, signalled once during training: it saves
    requeue.ckpt and stops instead of requeueing. Another with nothing left to train (max_steps=0),
    signalled in each attempt: the first requeues at step 0, the second is signalled at step 0 again and
    stops (a third would do the same). Each says its sentence in the log and in outcome.yaml."""
    common = (
        "trainer=cpu",
        "data=digits",
        "test=false",
        "callbacks.progress.log_every_n_s=0",
        "extras.print_config=false",
        f"paths.log_dir={tmp_path}",
        HOLD,
    )
    env = {"PYTHONPATH": str(ROOT)}
    submit = ("--output", f"{tmp_path}/%x-%j.out", *ONE_TASK, SBATCH_FILE)
    capped = slurm_cluster.sbatch(
        *submit, *common, "requeue.max_attempts=1", "trainer.max_epochs=1", cwd=ROOT, env=env
    )
    stuck = slurm_cluster.sbatch(*submit, *common, "trainer.max_steps=0", cwd=ROOT, env=env)

    _signal_when_held(slurm_cluster, tmp_path, capped, restart=0)
    _signal_when_held(slurm_cluster, tmp_path, stuck, restart=0)
    _signal_when_held(slurm_cluster, tmp_path, stuck, restart=1)  # requeued, then held again
    runs = tmp_path / "train" / "runs"

    # requeue.max_attempts=1: the first attempt would requeue; it stops, with its checkpoint named.
    info = slurm_cluster.wait(capped, timeout_s=120)
    log = _output(tmp_path, capped)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log[-3000:]
    checkpoint = runs / f"slurm-{capped}" / "checkpoints" / "requeue.ckpt"
    sentence = (
        f"requeue.max_attempts=1 reached: attempt 1 would requeue again; the last checkpoint is {checkpoint}; "
        f"raise requeue.max_attempts (null: no cap), or resubmit with ckpt_path={checkpoint}."
    )
    assert checkpoint.is_file() and f"[ERROR] - {sentence}" in log and f"error: {sentence}" in log, log[
        -3000:
    ]
    assert "requeued SLURM job" not in log
    outcome = yaml.safe_load((runs / f"slurm-{capped}" / "outcome.yaml").read_text())
    assert (outcome["status"], outcome["error"]) == ("stopped", sentence)

    # no progress: the second attempt was signalled at the step the first one was requeued at.
    info = slurm_cluster.wait(stuck, timeout_s=120)
    log = _output(tmp_path, stuck)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", log[-3000:]
    checkpoint = runs / f"slurm-{stuck}" / "checkpoints" / "requeue.ckpt"
    sentence = (
        "attempt 2 made no training progress: it was signalled at step 0, where attempt 1 was requeued, so "
        "every further attempt would end the same way (what runs before the first step or after training "
        f"takes longer than the time limit); the last checkpoint is {checkpoint}; give the job more time "
        f"(sbatch --time), or resubmit with ckpt_path={checkpoint}."
    )
    assert log.count(f"requeued SLURM job {stuck}") == 1 and f"error: {sentence}" in log, log[-3000:]
    outcome = yaml.safe_load((runs / f"slurm-{stuck}" / "outcome.yaml").read_text())
    assert (outcome["status"], outcome["error"]) == ("stopped", sentence)
    # its cost: both attempts, the first requeued with its checkpoint (nothing redone)
    cost = outcome["cost"]
    assert [a["ended"] for a in cost["attempts"]] == ["requeued", "stopped"]
    assert cost["unit"] == "CPU-core-hours" and cost["attempts"][0]["redone_hours"] == 0
    assert cost["total"]["device_hours"] == pytest.approx(sum(a["device_hours"] for a in cost["attempts"]))
    assert all(a["device_hours"] > 0 for a in cost["attempts"])
