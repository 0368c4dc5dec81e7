"""A sweep's summary groups its points: the points that differ only in seed and data.fold (or in the
keys given with --over, or all but those of --group-by) are one group, with n, mean, standard deviation,
standard error and the Student-t 95 % interval of the monitored metric and of each test metric, and its
failed and missing points named. Tested on sweep dirs written as real jobs write them (run.yaml,
outcome.yaml, .hydra/overrides.yaml), with values whose statistics are known."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.runtime.sweeps.groups import T_975, Stats, t_975
from hpctrain.runtime.sweeps.summary import COLUMNS, summarise
from tests.helpers import EXAMPLES, ROOT, assert_ok, train

T3, T1 = 3.182446, 12.706205  # Student's t, 97.5 %, 3 and 1 degrees of freedom


def write_job(
    sweep: Path,
    job: int,
    overrides: list[str],
    status: str | None = "completed",
    value: float | None = None,
    test: dict[str, float] | None = None,
    error: str | None = None,
) -> Path:
    """A job's run dir as `hpctrain.runtime.storage.records` leaves it; `status=None`: started, no outcome yet."""
    run_dir = sweep / str(job)
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    record = {
        "command": "train.py " + " ".join(overrides),
        "overrides": overrides,
        "git": {"commit": "0" * 40, "dirty": False},
        "versions": {"python": "3.11.9"},
        "attempts": [
            {"started": "2026-11-25 10:00:00", "host": "node1", "launcher": "local", "slurm_log": None}
        ],
    }
    (run_dir / "run.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    if status is not None:
        outcome: dict[str, Any] = {
            "status": status,
            "metric": "val/acc",
            "value": value,
            "error": error,
            "overrides": overrides,
            "finished": "2026-11-25 10:05:00",
        }
        if test:
            outcome["test"] = test
        (run_dir / "outcome.yaml").write_text(yaml.safe_dump(outcome, sort_keys=False))
    return run_dir


def read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    """lr x seed x fold, 2 x 2 x 2: lr=0.1 complete; lr=0.01 with one failed point and one never run."""
    sweep = tmp_path / "multirun"
    values = {  # (lr, seed, fold) -> val/acc, test/acc
        ("0.1", 1, 0): (0.80, 0.70),
        ("0.1", 1, 1): (0.82, 0.72),
        ("0.1", 2, 0): (0.84, 0.74),
        ("0.1", 2, 1): (0.86, 0.80),
        ("0.01", 1, 0): (0.50, 0.40),
        ("0.01", 2, 0): (0.70, 0.60),
    }
    job = 0
    for lr in ("0.1", "0.01"):
        for seed in (1, 2):
            for fold in (0, 1):
                overrides = [
                    f"model.optimizer.lr={lr}",
                    f"seed={seed}",
                    "data.num_folds=2",
                    f"data.fold={fold}",
                ]
                if (lr, seed, fold) in values:
                    val, test = values[lr, seed, fold]
                    write_job(
                        sweep, job, overrides, value=val, test={"test/acc": test, "test/loss": 1 - test}
                    )
                elif seed == 1:
                    write_job(sweep, job, overrides, status="failed", error="model.optimizer.lr is too small")
                job += 1  # (0.01, 2, 1), job 7, never ran: no run dir
    return sweep


def test_points_that_differ_in_seed_and_fold_are_one_group(grid: Path):
    summary = summarise(grid)
    assert [p.name for p in summary.files] == ["summary.csv", "summary_groups.csv", "summary.png"]
    rows = read(grid / "summary.csv")
    assert tuple(rows[0]) == COLUMNS  # the per-job columns first, as before, then the group's
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "4", "5", "6"]
    assert rows[0]["overrides"] == "model.optimizer.lr=0.1 seed=1 data.fold=0"

    std = math.sqrt((0.03**2 + 0.01**2 + 0.01**2 + 0.03**2) / 3)  # 0.80, 0.82, 0.84, 0.86 about 0.83
    first = rows[0]
    assert first["group"] == "model.optimizer.lr=0.1" and first["group_n"] == "4"
    assert float(first["group_mean"]) == pytest.approx(0.83, abs=1e-12)
    assert float(first["group_std"]) == pytest.approx(std, abs=1e-12)
    assert float(first["group_sem"]) == pytest.approx(std / 2, abs=1e-12)
    assert float(first["group_ci95_low"]) == pytest.approx(0.83 - T3 * std / 2, abs=1e-12)
    assert float(first["group_ci95_high"]) == pytest.approx(0.83 + T3 * std / 2, abs=1e-12)
    assert {r["group_mean"] for r in rows[:4]} == {first["group_mean"]}  # every point of the group

    failed = rows[5]  # lr=0.01, seed 1, fold 1
    assert failed["status"] == "failed" and failed["value"] == ""
    assert failed["group"] == "model.optimizer.lr=0.01" and failed["group_n"] == "2"
    assert float(failed["group_mean"]) == pytest.approx(0.6, abs=1e-12)
    assert float(failed["group_std"]) == pytest.approx(math.sqrt(0.02), abs=1e-12)  # 0.5 and 0.7
    assert float(failed["group_ci95_low"]) == pytest.approx(0.6 - T1 * 0.1, abs=1e-12)

    groups = read(grid / "summary_groups.csv")
    assert [g["group"] for g in groups] == ["model.optimizer.lr=0.1", "model.optimizer.lr=0.01"]
    complete, broken = groups
    assert (complete["points"], complete["completed"], complete["failed"], complete["missing"]) == (
        "4",
        "4",
        "0",
        "0",
    )
    assert complete["failed_points"] == complete["missing_points"] == ""
    assert (broken["points"], broken["completed"], broken["failed"], broken["missing"]) == (
        "4",
        "2",
        "1",
        "1",
    )
    assert broken["failed_points"] == "job 5 (seed=1 data.fold=1)"
    assert broken["missing_points"] == "seed=2 data.fold=1 (no run dir)"
    # the test metrics too: 0.70, 0.72, 0.74, 0.80 (mean 0.74)
    test_std = math.sqrt((0.04**2 + 0.02**2 + 0 + 0.06**2) / 3)
    assert complete["test/acc_n"] == "4"
    assert float(complete["test/acc_mean"]) == pytest.approx(0.74, abs=1e-12)
    assert float(complete["test/acc_std"]) == pytest.approx(test_std, abs=1e-12)
    assert float(complete["test/acc_ci95_high"]) == pytest.approx(0.74 + T3 * test_std / 2, abs=1e-12)
    assert float(complete["test/loss_mean"]) == pytest.approx(0.26, abs=1e-12)
    assert float(broken["val/acc_mean"]) == pytest.approx(0.6, abs=1e-12) and broken["val/acc_n"] == "2"
    assert list(groups[0])[:7] == [
        "group",
        "points",
        "completed",
        "failed",
        "missing",
        "failed_points",
        "missing_points",
    ]
    assert (grid / "summary.png").stat().st_size > 1000


def test_the_keys_averaged_over_can_be_chosen(grid: Path):
    summarise(grid, over=["seed"])  # lr and fold define the groups
    groups = {g["group"]: g for g in read(grid / "summary_groups.csv")}
    assert list(groups) == [
        "model.optimizer.lr=0.1 data.fold=0",
        "model.optimizer.lr=0.1 data.fold=1",
        "model.optimizer.lr=0.01 data.fold=0",
        "model.optimizer.lr=0.01 data.fold=1",
    ]
    assert float(groups["model.optimizer.lr=0.1 data.fold=0"]["val/acc_mean"]) == pytest.approx(
        0.82, abs=1e-12
    )
    last = groups["model.optimizer.lr=0.01 data.fold=1"]  # one failed point, one never run: no value
    assert (last["val/acc_n"], last["val/acc_mean"], last["val/acc_std"]) == ("0", "", "")
    assert last["failed_points"] == "job 5 (seed=1)" and last["missing_points"] == "seed=2 (no run dir)"

    summarise(grid, group_by=["data.fold"])  # lr and seed averaged over
    groups = {g["group"]: g for g in read(grid / "summary_groups.csv")}
    assert list(groups) == ["data.fold=0", "data.fold=1"]
    assert groups["data.fold=0"]["val/acc_n"] == "4"
    assert float(groups["data.fold=0"]["val/acc_mean"]) == pytest.approx(
        (0.80 + 0.84 + 0.50 + 0.70) / 4, abs=1e-12
    )
    assert groups["data.fold=1"]["missing_points"] == "model.optimizer.lr=0.01 seed=2 (no run dir)"


def test_a_point_alone_has_no_spread_and_an_unfinished_point_is_missing(tmp_path: Path):
    sweep = tmp_path / "multirun"
    write_job(sweep, 0, ["model.optimizer.lr=0.1"], value=0.9)
    write_job(sweep, 1, ["model.optimizer.lr=0.01"], status=None)  # started, still running
    summarise(sweep)
    rows = read(sweep / "summary.csv")
    assert (rows[0]["group"], rows[0]["group_n"], rows[0]["group_mean"]) == (
        "model.optimizer.lr=0.1",
        "1",
        "0.9",
    )
    assert (
        rows[0]["group_std"]
        == rows[0]["group_sem"]
        == rows[0]["group_ci95_low"]
        == rows[0]["group_ci95_high"]
        == ""
    )
    assert rows[1]["status"] == "running" and rows[1]["group_n"] == "0" and rows[1]["group_mean"] == ""
    groups = read(sweep / "summary_groups.csv")
    assert groups[1]["missing"] == "1" and groups[1]["missing_points"] == "job 1 running"
    assert "test/acc_mean" not in groups[0]  # no point tested: no test columns


def test_a_random_search_is_not_taken_for_a_grid(tmp_path: Path):
    """Four learning rates drawn at random, two seeds: grouped by seed, no learning rate is 'missing'."""
    sweep = tmp_path / "multirun"
    for job, (lr, seed) in enumerate([(0.013, 1), (0.0021, 1), (0.047, 2), (0.0008, 2)]):
        write_job(sweep, job, [f"model.optimizer.lr={lr}", f"seed={seed}"], value=0.5 + job / 10)
    summarise(sweep, group_by=["seed"])
    groups = read(sweep / "summary_groups.csv")
    assert [(g["group"], g["val/acc_n"], g["missing"]) for g in groups] == [
        ("seed=1", "2", "0"),
        ("seed=2", "2", "0"),
    ]


def test_the_t_quantiles_and_statistics():
    assert t_975(1) == T1 and t_975(3) == T3 and len(T_975) == 30
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (*range(1, 31), 31, 40, 60, 120, 1000):
        assert t_975(df) == pytest.approx(float(scipy_stats.t.ppf(0.975, df)), abs=1e-6), df
    stats = Stats.of([2.0, 4.0, 6.0])  # mean 4, std 2, sem 2/sqrt(3)
    assert (stats.n, stats.mean, stats.std) == (3, 4.0, 2.0)
    assert stats.sem == pytest.approx(2 / math.sqrt(3), abs=1e-15)
    assert stats.ci95 == pytest.approx(
        (4 - 4.302653 * 2 / math.sqrt(3), 4 + 4.302653 * 2 / math.sqrt(3)), abs=1e-12
    )
    assert Stats.of([]) == Stats(0) and Stats.of([1.5]) == Stats(1, 1.5)


def test_summarize_takes_the_keys_on_its_command_line(grid: Path, capsys: pytest.CaptureFixture[str]):
    spec = importlib.util.spec_from_file_location("summarize", ROOT / "scripts" / "summarize.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(grid), "--group-by", "seed"]) == 0
    assert [g["group"] for g in read(grid / "summary_groups.csv")] == ["seed=1", "seed=2"]
    with pytest.raises(SystemExit) as refused:
        script.main([str(grid), "--over", "seed", "--group-by", "data.fold"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES, reason="a project generated without the examples has no digits data")
def test_a_real_sweep_over_seeds_and_folds_is_one_group(tmp_path: Path):
    result = train(
        tmp_path,
        "-m",
        "experiment=quickstart",
        "trainer.max_epochs=1",
        "data.num_folds=2",
        "data.fold=0,1",
        "seed=1,2",
    )
    assert_ok(result)
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    (group,) = read(sweep / "summary_groups.csv")
    assert (group["group"], group["points"], group["val/acc_n"], group["test/acc_n"]) == (
        "all",
        "4",
        "4",
        "4",
    )
    values = [float(r["value"]) for r in read(sweep / "summary.csv")]
    assert float(group["val/acc_mean"]) == pytest.approx(sum(values) / 4, abs=1e-12)
    assert (
        float(group["val/acc_ci95_low"]) <= float(group["val/acc_mean"]) <= float(group["val/acc_ci95_high"])
    )
    assert "test/acc" in yaml.safe_load((sweep / "0" / "outcome.yaml").read_text())["test"]
    assert "group all: n=4, val/acc " in result.stdout and (sweep / "summary.png").stat().st_size > 1000
