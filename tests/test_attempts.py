"""A run's attempts: the requeue budgets (`requeue.max_attempts`, no progress), the signal lead
(`requeue.signal_lead_s` against the sbatch files and against the time a save takes) and the cost in
outcome.yaml and in sweep summaries. The rules are functions of recorded attempts, tested on records
written as run.yaml holds them; a real run records its cost and warns about a save too slow for the lead.
On the Slurm cluster: tests/test_slurm_budgets.py, and the requeue test of tests/test_slurm.py (cost)."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.runtime.storage.attempts import (
    budget_spent,
    cost,
    previous_requeue_step,
    slow_save_warning,
)
from hpctrain.runtime.sweeps.summary import summarise
from tests.helpers import ROOT, assert_ok, run_dirs, train
from tests.test_summary import write_job

CHECKPOINT = "/runs/slurm-7/checkpoints/requeue.ckpt"
T0 = 1_800_000_000.0  # seconds since the epoch


def _attempt(restart: int, run_id: str = "slurm-7", **fields: Any) -> dict[str, Any]:
    return {"run_id": run_id, "slurm_restart_count": restart, "world_size": 1, **fields}


def test_max_attempts_stops_the_attempt_that_would_requeue_again():
    assert budget_spent(9, 900, 800, 10, CHECKPOINT) is None
    assert str(budget_spent(10, 1000, 900, 10, CHECKPOINT)) == (
        f"requeue.max_attempts=10 reached: attempt 10 would requeue again; the last checkpoint is {CHECKPOINT}; "
        f"raise requeue.max_attempts (null: no cap), or resubmit with ckpt_path={CHECKPOINT}."
    )
    assert str(budget_spent(1, 3, None, 1, None)) == (
        "requeue.max_attempts=1 reached: attempt 1 would requeue again; no checkpoint was saved; raise "
        "requeue.max_attempts (null: no cap), or resubmit."
    )
    assert budget_spent(50, 5000, 4900, None, CHECKPOINT) is None  # null: no cap


def test_an_attempt_signalled_where_the_one_before_was_requeued_stops_the_job():
    attempts = [_attempt(0, ended={"how": "requeued", "step": 80}), _attempt(1)]
    assert previous_requeue_step(attempts, "slurm-7", 1) == 80
    sentence = str(budget_spent(2, 80, 80, 10, CHECKPOINT))
    assert sentence.startswith(
        "attempt 2 made no training progress: it was signalled at step 80, where attempt 1 was requeued, so "
        "every further attempt would end the same way"
    )
    assert sentence.endswith(
        f"give the job more time (sbatch --time), or resubmit with ckpt_path={CHECKPOINT}."
    )
    assert budget_spent(2, 81, 80, 10, CHECKPOINT) is None  # one step further is progress
    # the first attempt, another job's attempts, an attempt before that ended otherwise: no rule
    assert previous_requeue_step(attempts, "slurm-7", 0) is None
    assert previous_requeue_step(attempts, "slurm-8", 1) is None
    killed = [_attempt(0, seen={"at": T0, "step": 80}), _attempt(1)]
    assert previous_requeue_step(killed, "slurm-7", 1) is None


def test_a_save_that_does_not_fit_in_the_signal_lead_is_named_with_both_times():
    assert slow_save_warning(30.0, 0.5, 1, 90, "SIGUSR1") is None
    assert slow_save_warning(80.0, 0.5, 20, 90, "SIGUSR1") is None  # 80 s + 20 steps of 0.5 s = 90 s
    warning = slow_save_warning(85.0, 0.5, 20, 90, "SIGUSR1")
    assert warning == (
        "a checkpoint save took 85.00 s and a signal waits up to 10.00 s for the next check (20 training steps): "
        "95.00 s, more than the 90 s that SIGUSR1 comes before the time limit (requeue.signal_lead_s=90), so the "
        "checkpoint at the time limit may be cut off; raise --signal=SIGUSR1@N in the sbatch file and "
        "requeue.signal_lead_s=N together (N=190 or more), or save less (a smaller checkpoint, a faster "
        "filesystem for paths.log_dir)."
    )


def test_the_signal_lead_is_the_one_the_sbatch_files_ask_for():
    """Slurm does not tell a job when its signal comes: requeue.signal_lead_s must be the N of every sbatch
    file's `--signal=<requeue.signal>@N`."""
    requeue = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["requeue"]
    expected = ("SIG" + requeue["signal"].removeprefix("SIG"), requeue["signal_lead_s"])
    files = sorted((ROOT / "slurm").glob("*.sbatch"))
    assert [f.name for f in files] == ["pack.sbatch", "sweep.sbatch", "train.sbatch"]
    for sbatch in files:
        asked = re.findall(
            r"^#SBATCH\s+--signal=(?:B:)?(?:SIG)?(\w+)@(\d+)", sbatch.read_text(), re.MULTILINE
        )
        assert [(f"SIG{name}", int(lead)) for name, lead in asked] == [expected], sbatch


def test_the_cost_of_each_attempt_adds_up():
    gpus = {"kind": "GPU", "per_process": 1}
    attempts = [
        {  # requeued at the signal, with the checkpoint it saved then: nothing redone
            "world_size": 4,
            "devices": gpus,
            "started_s": T0,
            "trained_from": {"at": T0 + 60, "step": 0},
            "saved": {"at": T0 + 1800, "step": 900},
            "ended": {"at": T0 + 3600, "how": "requeued", "step": 1800, "checkpoint": CHECKPOINT},
        },
        {  # killed: it ended about its last sign of life; from its last checkpoint to there is redone
            "world_size": 4,
            "devices": gpus,
            "started_s": T0 + 3700,
            "trained_from": {"at": T0 + 3760, "step": 1800},
            "saved": {"at": T0 + 5000, "step": 2400},
            "seen": {"at": T0 + 5900, "step": 2850},
        },
        {  # killed before it saved anything: all its training is redone
            "world_size": 4,
            "devices": gpus,
            "started_s": T0 + 6000,
            "trained_from": {"at": T0 + 6360, "step": 2400},
            "seen": {"at": T0 + 7200, "step": 2800},
        },
        {
            "world_size": 4,
            "devices": gpus,
            "started_s": T0 + 7200,
            "ended": {"at": T0 + 10800, "how": "completed"},
        },
    ]
    found = cost(attempts, now=T0 + 20_000)
    assert found is not None and found["unit"] == "GPU-hours"
    rows = found["attempts"]
    assert [r["ended"] for r in rows] == ["requeued", "killed", "killed", "completed"]
    assert [r["wall_hours"] for r in rows] == pytest.approx([1.0, 2200 / 3600, 1200 / 3600, 1.0], abs=1e-6)
    assert [r["device_hours"] for r in rows] == pytest.approx([4 * r["wall_hours"] for r in rows], abs=1e-5)
    assert [r["redone_hours"] for r in rows] == pytest.approx([0, 900 / 3600, 840 / 3600, 0], abs=1e-6)
    total = found["total"]
    assert total["attempts"] == 4
    for key in ("wall_hours", "device_hours", "redone_hours", "redone_device_hours"):
        assert total[key] == pytest.approx(sum(r[key] for r in rows), abs=1e-9)
    # CPU cores: processes x cores per process; a record from before `devices` counts one core per process
    cpu = cost(
        [{"world_size": 2, "devices": {"kind": "CPU core", "per_process": 8}, "started_s": T0}], T0 + 1800
    )
    assert cpu is not None and cpu["unit"] == "CPU-core-hours" and cpu["total"]["device_hours"] == 8.0
    old = cost([{"world_size": 1, "started": "2026-11-25 10:00:00"}], now=T0)
    assert old is not None and old["attempts"][0]["ended"] == "running"


def test_sweep_summaries_add_up_the_cost_per_point_and_per_group(tmp_path: Path):
    sweep = tmp_path / "multirun"
    spent = {  # (lr, seed) -> device_hours of attempts
        ("0.1", 1): [0.5, 0.25],
        ("0.1", 2): [0.5],
        ("0.01", 1): [1.0],
        ("0.01", 2): [2.0, 0.5, 0.25],
    }
    for job, ((lr, seed), hours) in enumerate(spent.items()):
        run_dir = write_job(sweep, job, [f"model.optimizer.lr={lr}", f"seed={seed}"], value=0.5)
        attempts = [
            {"attempt": i + 1, "wall_hours": h / 2, "device_hours": h, "redone_device_hours": h / 10}
            for i, h in enumerate(hours)
        ]
        total = {
            "attempts": len(hours),
            **{
                k: round(sum(a[k] for a in attempts), 6)
                for k in ("wall_hours", "device_hours", "redone_device_hours")
            },
        }
        outcome = yaml.safe_load((run_dir / "outcome.yaml").read_text())
        outcome["cost"] = {"unit": "GPU-hours", "attempts": attempts, "total": total}
        (run_dir / "outcome.yaml").write_text(yaml.safe_dump(outcome, sort_keys=False))
    write_job(sweep, 4, ["model.optimizer.lr=0.01", "seed=3"], status="failed", error="refused")  # no cost

    summarise(sweep)
    with open(sweep / "summary.csv", newline="") as file:
        points = list(csv.DictReader(file))
    assert [float(p["device_hours"] or 0) for p in points] == pytest.approx([0.75, 0.5, 1.0, 2.75, 0])
    assert [p["attempts"] for p in points] == ["2", "1", "1", "3", ""]
    assert [p["cost_unit"] for p in points] == ["GPU-hours"] * 4 + [""]
    with open(sweep / "summary_groups.csv", newline="") as file:
        groups = {g["group"]: g for g in csv.DictReader(file)}
    assert float(groups["model.optimizer.lr=0.1"]["device_hours"]) == pytest.approx(1.25)
    assert float(groups["model.optimizer.lr=0.01"]["device_hours"]) == pytest.approx(3.75)
    assert float(groups["model.optimizer.lr=0.01"]["redone_device_hours"]) == pytest.approx(0.375)
    assert [groups[g]["attempts"] for g in groups] == ["3", "4"]
    assert sum(float(g["device_hours"]) for g in groups.values()) == pytest.approx(
        sum(float(p["device_hours"] or 0) for p in points)
    )


@pytest.mark.slow
def test_a_run_records_its_cost_and_warns_once_when_a_save_does_not_fit_in_the_signal_lead(tmp_path: Path):
    result = train(
        tmp_path, "experiment=quickstart", "trainer.max_epochs=2", "test=false", "requeue.signal_lead_s=0.001"
    )
    assert_ok(result)
    warnings = re.findall(
        r"a checkpoint save took (\d+\.\d+) s and a signal waits up to (\d+\.\d+) s for the next check "
        r"\(1 training step\): \d+\.\d+ s, more than the 0\.001 s that SIGUSR1 comes before the time limit "
        r"\(requeue\.signal_lead_s=0\.001\)",
        result.stdout,
    )
    assert len(warnings) == 1, result.stdout[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    (attempt,) = yaml.safe_load((run_dir / "run.yaml").read_text())["attempts"]
    assert (
        attempt["saved"]["path"] == str(run_dir / "checkpoints" / "last.ckpt")
        and attempt["saved"]["step"] > 0
    )
    assert attempt["ended"]["how"] == "completed" and attempt["devices"]["kind"] == "CPU core"

    found = yaml.safe_load((run_dir / "outcome.yaml").read_text())["cost"]
    (row,) = found["attempts"]
    assert found["unit"] == "CPU-core-hours" and row["ended"] == "completed" and row["processes"] == 1
    assert row["device_hours"] == pytest.approx(row["wall_hours"] * row["per_process"], abs=1e-5)
    assert 0 < found["total"]["device_hours"] == row["device_hours"] and found["total"]["redone_hours"] == 0
