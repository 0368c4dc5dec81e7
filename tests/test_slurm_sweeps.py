"""Sweeps as SLURM jobs on the real two-node cluster: a job-array grid (4 concurrent jobs logging to csv,
TensorBoard and MLflow), packed jobs (points side by side in one allocation, requeued together), the
SLURM launcher (results collected, a preempted job resuming), and an Optuna study whose trials are SLURM
jobs (and whose trials' repeats over seeds are one job array)."""

from __future__ import annotations

import csv
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import PYTHON, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

QUICK = ("experiment=quickstart", "trainer.max_epochs=1", "extras.print_config=false")
LAUNCHER = ("hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1")


def _rows(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "summary.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_a_job_array_sweep_of_four_concurrent_jobs(slurm_cluster, tmp_path: Path):
    submitted = slurm_cluster.run(
        PYTHON,
        "scripts/submit.py",
        "--sweep",
        "--parallel",
        "4",
        "--nodes",
        "1",
        "--cpu",
        "--cpus-per-task",
        "1",
        "--mem",
        "1G",
        f"--sbatch-arg=--output={tmp_path}/%x-%A_%a.out",
        "--",
        *QUICK,
        "logger=[many,mlflow]",
        "model.optimizer.lr=0.003,0.01",
        "data.batch_size=32,64",
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "--array=0-3%4" in submitted.stdout
    array = submitted.stdout.strip().split()[-1]
    deadline = time.monotonic() + 300
    while slurm_cluster.run("squeue", "-h", "-j", array).stdout.strip():
        assert time.monotonic() < deadline
        time.sleep(1)
    sweep = tmp_path / "train" / "multiruns" / f"slurm-{array}"
    result = subprocess.run(
        [PYTHON, "scripts/summarize.py", str(sweep)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _rows(sweep)
    assert [r["status"] for r in rows] == ["completed"] * 4, rows
    # Hydra's job order: the last swept key varies fastest
    assert [r["overrides"] for r in rows] == [
        "model.optimizer.lr=0.003 data.batch_size=32",
        "model.optimizer.lr=0.003 data.batch_size=64",
        "model.optimizer.lr=0.01 data.batch_size=32",
        "model.optimizer.lr=0.01 data.batch_size=64",
    ]
    from mlflow.tracking import MlflowClient

    for task, row in enumerate(rows):
        run = Path(row["run_dir"])
        assert row["slurm_log"].startswith(str(tmp_path)) and row["slurm_log"].endswith(
            f"-{array}_{task}.out"
        )
        assert "database is locked" not in Path(row["slurm_log"]).read_text()
        client = MlflowClient(
            tracking_uri=f"sqlite:///{run}/mlflow.db"
        )  # one store per job: no shared SQLite
        (logged,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])
        assert logged.data.metrics["val/acc"] == pytest.approx(float(row["value"]))
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.ondemand  # CI: the launcher collects results with Optuna repeats, and resumes a preempted job
def test_the_slurm_launcher_runs_a_sweep_and_collects_results(slurm_cluster, tmp_path: Path):
    result = slurm_cluster.run(
        PYTHON,
        "src/train.py",
        "-m",
        *LAUNCHER,
        "trainer=ddp_cpu",
        "trainer.num_nodes=2",
        "trainer.devices=1",
        *QUICK,
        "model.optimizer.lr=0.003,-1",
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    rows = _rows(sweep)
    assert [r["status"] for r in rows] == ["completed", "failed"]
    assert "model.optimizer.lr=-1 is not a positive number" in rows[1]["error"]
    record = yaml.safe_load((Path(rows[0]["run_dir"]) / "run.yaml").read_text())
    attempt = record["attempts"][0]
    assert (attempt["launcher"], attempt["world_size"]) == ("slurm", 2)  # nodes and tasks from the trainer
    # the job ran the code as launched: a snapshot of it, with its conf/
    snapshot = Path(record["git"]["snapshot"])
    assert snapshot.parent == ROOT / "logs" / "snapshots" and (snapshot / "conf" / "train.yaml").is_file()
    assert "the jobs run from a snapshot of the code" in result.stdout + result.stderr
    assert Path(rows[0]["slurm_log"]).is_file()
    log = result.stderr + result.stdout
    assert "job 0: SLURM job" in log and f"run dir {sweep}/0" in log  # said as soon as submitted
    assert "job 1 failed" in log


@pytest.mark.ondemand  # the pack driver runs in CI through submit.py (packed points, requeued)
def test_the_slurm_launcher_packs_jobs_two_to_an_allocation(slurm_cluster, tmp_path: Path):
    """hydra.launcher.pack=2: 4 jobs in 2 allocations of 2 (slurm/pack.sbatch, its driver), the results read
    from their outcome.yaml; launched again with skip_completed=true, nothing is submitted."""
    launch = (
        PYTHON,
        "src/train.py",
        "-m",
        *LAUNCHER,
        "hydra.launcher.pack=2",
        "trainer=ddp_cpu",
        "trainer.num_nodes=1",
        "trainer.devices=1",
        *QUICK,
        "test=false",
        f"paths.log_dir={tmp_path}",
        "seed=1,2,3,4",
    )
    result = slurm_cluster.run(*launch, cwd=ROOT)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    submitted = re.findall(r"job (\d): SLURM job (\d+)_(\d)", log)
    assert [(n, task) for n, _, task in submitted] == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], log
    (array,) = {a for _, a, _ in submitted}
    rows = _rows(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [(str(n), "completed") for n in range(4)], rows
    for number, row in enumerate(rows):
        task = f"{array}_{number // 2}"
        assert row["run_dir"] == str(sweep / str(number)) and row["value"]
        assert row["slurm_log"] == str(sweep / ".pack" / f"{task}.point{number}.out")
        (attempt,) = yaml.safe_load((sweep / str(number) / "run.yaml").read_text())["attempts"]
        assert (attempt["slurm_job_id"], attempt["world_size"]) == (task, 1)
    driver = (sweep / ".pack" / f"{array}_0.out").read_text()
    assert (
        "points 0, 1 of the 4 in jobs-0.yaml, side by side" in driver
        and "2 of 2 point(s) completed" in driver
    )

    again = slurm_cluster.run(*launch, f"hydra.sweep.dir={sweep}", "skip_completed=true", cwd=ROOT)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-4000:]
    assert "skip_completed: 4 point(s) had completed in" in log and "SLURM job" not in log, log[-4000:]


def test_the_slurm_launcher_refuses_sweeping_the_allocation(slurm_cluster, tmp_path: Path):
    result = slurm_cluster.run(
        PYTHON,
        "src/train.py",
        "-m",
        *LAUNCHER,
        "trainer=ddp_cpu",
        "trainer.num_nodes=1,2",
        *QUICK,
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "error: trainer.num_nodes takes 2 values in this sweep (1, 2)" in result.stderr


def test_a_preempted_slurm_launcher_job_resumes_and_finishes(slurm_cluster, tmp_path: Path):
    launching = subprocess.Popen(
        [
            PYTHON,
            "src/train.py",
            "-m",
            *LAUNCHER,
            "trainer=ddp_cpu",
            "trainer.num_nodes=2",
            "trainer.devices=1",
            "experiment=quickstart",
            "data.batch_size=8",
            "trainer.max_epochs=1",  # signalled at step 10 of 79: the rest of the epoch is the resumed part
            "callbacks.progress.log_every_n_s=0",
            # 0.1 s per step, or on a quiet machine the epoch ends before the signal arrives
            "+callbacks.slow._target_=tests.differential.user_code.SlowRankCallback",
            "extras.print_config=false",
            f"paths.log_dir={tmp_path}",
            "model.optimizer.lr=0.003",
        ],
        cwd=ROOT,
        env={**slurm_cluster.env, "PYTHONPATH": str(ROOT), "SLOW_RANK": "0", "SLOW_S": "0.1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    logs: list[Path] = []
    while not logs or "epoch 0/1  step 10/" not in logs[0].read_text():
        assert time.monotonic() < deadline and launching.poll() is None
        logs = list(tmp_path.glob("train/multiruns/*/.submitit/*/*_0_log.out"))
        time.sleep(0.5)
    job = logs[0].name.split("_0_log")[0]  # <array>_<task>
    assert slurm_cluster.run("scancel", "--signal=USR1", job).returncode == 0
    deadline = time.monotonic() + 240
    while launching.poll() is None:  # the requeued job starts again ~10 s later, then finishes
        assert time.monotonic() < deadline, slurm_cluster.job(job)
        time.sleep(1)
    output = launching.stdout.read()
    assert launching.returncode == 0, output[-3000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    (row,) = _rows(sweep)
    assert row["status"] == "completed"
    run = Path(row["run_dir"])
    attempts = yaml.safe_load((run / "run.yaml").read_text())["attempts"]
    assert [a["slurm_restart_count"] for a in attempts] == [0, 1]
    text = logs[0].read_text()
    assert (
        "requeued SLURM job" in text
        and f"starting from {run}/checkpoints/requeue.ckpt (restart 1 of this job)" in text
    )


@pytest.mark.ondemand  # Optuna through the launcher runs in CI with repeats (one array)
def test_an_optuna_study_through_the_slurm_launcher(slurm_cluster, tmp_path: Path):
    result = slurm_cluster.run(
        PYTHON,
        "src/train.py",
        "-m",
        "hparams_search=quickstart_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        *LAUNCHER,
        "trainer=ddp_cpu",
        "trainer.num_nodes=1",
        "trainer.devices=1",
        *QUICK,
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    assert [r["status"] for r in _rows(sweep)] == ["completed", "completed"]
    assert yaml.safe_load((sweep / "optuna_best.yaml").read_text())["completed"] == 2


def test_an_optuna_trials_repeats_are_slurm_jobs_of_one_array(slurm_cluster, tmp_path: Path):
    """hydra.sweeper.repeats=2 with n_jobs=2: both trials' 4 jobs are submitted at once, as one array."""
    result = slurm_cluster.run(
        PYTHON,
        "src/train.py",
        "-m",
        "hparams_search=quickstart_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.repeats=2",
        *LAUNCHER,
        "trainer=ddp_cpu",
        "trainer.num_nodes=1",
        "trainer.devices=1",
        *QUICK,
        "test=false",
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    rows = _rows(sweep)
    assert [r["status"] for r in rows] == ["completed"] * 4
    submitted = re.findall(r"job (\d): SLURM job (\d+)_(\d)", result.stdout + result.stderr)
    assert (
        sorted(n for n, _, _ in submitted) == ["0", "1", "2", "3"] and len({a for _, a, _ in submitted}) == 1
    )
    best = yaml.safe_load((sweep / "optuna_best.yaml").read_text())
    assert best["completed"] == 2 and best["repeats"] == 2
    values = {int(r["job"]): float(r["value"]) for r in rows}
    assert best["value"] == pytest.approx(sum(values[j] for j in best["jobs"]) / 2)


@pytest.mark.ondemand  # CI: a local sweep re-run into its dir skips what completed (tests/test_sweeps.py)
def test_a_job_array_re_run_submits_only_the_points_that_did_not_complete(slurm_cluster, tmp_path: Path):
    submit = (
        PYTHON,
        "scripts/submit.py",
        "--sweep",
        "--nodes",
        "1",
        "--cpu",
        "--cpus-per-task",
        "1",
        "--mem",
        "1G",
        f"--sbatch-arg=--output={tmp_path}/%x-%A_%a.out",
        "--",
        *QUICK,
        f"paths.log_dir={tmp_path}",
    )
    first = slurm_cluster.run(*submit, "model.optimizer.lr=0.01,-1", cwd=ROOT)  # point 1 is refused
    assert first.returncode == 0, first.stderr
    array = first.stdout.strip().split()[-1]
    for task in ("0", "1"):
        slurm_cluster.wait(f"{array}_{task}", timeout_s=300)
    sweep = tmp_path / "train" / "multiruns" / f"slurm-{array}"
    again = slurm_cluster.run(
        *submit, "model.optimizer.lr=0.01,0.003", f"hydra.sweep.dir={sweep}", "skip_completed=true", cwd=ROOT
    )
    assert again.returncode == 0, again.stderr
    assert "skip_completed: 1 of 2 point(s) completed in" in again.stderr and "--array=1 " in again.stdout
    second = again.stdout.strip().split()[-1]
    info = slurm_cluster.wait(f"{second}_1", timeout_s=300)
    assert info["JobState"] == "COMPLETED"
    assert yaml.safe_load((sweep / "1" / "outcome.yaml").read_text())["status"] == "completed"
    assert not (tmp_path / "train" / "multiruns" / f"slurm-{second}").exists()  # into the earlier sweep's dir
    done = slurm_cluster.run(
        *submit, "model.optimizer.lr=0.01,0.003", f"hydra.sweep.dir={sweep}", "skip_completed=true", cwd=ROOT
    )
    assert done.returncode == 0 and "nothing to submit" in done.stdout


def test_packed_points_share_a_job_and_its_requeue_and_resume_exactly(slurm_cluster, tmp_path: Path):
    """--sweep --pack 2: 4 points in 2 jobs of 2, each point its own srun step, run dir and outcome. Job 0 is
    signalled mid-epoch: both its points save and end, its driver requeues the job once, and both resume
    exactly: they end as the other job's identical, uninterrupted points (the grid is seed=1,2,1,2)."""
    import torch

    from tests.helpers import metrics_without_timing

    submitted = slurm_cluster.run(
        PYTHON,
        "scripts/submit.py",
        "--sweep",
        "--pack",
        "2",
        "--cpu",
        "--cpus-per-task",
        "1",
        "--mem",
        "1G",
        f"--sbatch-arg=--output={tmp_path}/%x-%A_%a.out",
        "--",
        "experiment=quickstart",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "data.batch_size=8",  # 158 steps
        "extras.print_config=false",
        "callbacks.progress.log_every_n_s=0",
        # 0.1 s per step, or on a quiet machine the epoch ends before the signal arrives
        "+callbacks.slow._target_=tests.differential.user_code.SlowRankCallback",
        f"paths.log_dir={tmp_path}",
        "seed=1,2,1,2",
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "SLOW_RANK": "0", "SLOW_S": "0.1"},
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "--array=0-1 " in submitted.stdout and "--ntasks-per-node=2 " in submitted.stdout
    array = submitted.stdout.strip().split()[-1]
    job, reference = f"{array}_0", f"{array}_1"

    def output(task: str, point: int | None = None) -> str:
        path = tmp_path / f"myproject-pack-{task}{'' if point is None else f'.point{point}'}.out"
        return path.read_text() if path.exists() else ""

    deadline = time.monotonic() + 180
    while not all("epoch 0/1  step 10/" in output(job, point) for point in (0, 1)):
        assert time.monotonic() < deadline, output(job)[-2000:] + output(job, 0)[-2000:]
        assert slurm_cluster.job(job).get("JobState") in ("PENDING", "RUNNING"), output(job)[-2000:]
        time.sleep(0.2)
    assert slurm_cluster.run("scancel", "--signal=USR1", job).returncode == 0
    for task in (job, reference):
        info = slurm_cluster.wait(task, timeout_s=240)
        assert info["JobState"] == "COMPLETED", output(task)[-3000:]
    assert (slurm_cluster.job(job)["Restarts"], slurm_cluster.job(reference)["Restarts"]) == ("1", "0")

    # The driver: both points saved and ended, then one requeue; the second attempt ran both again.
    driver = output(job)
    assert "point 0 ended: requeued" in driver and "point 1 ended: requeued" in driver, driver
    assert driver.count(f"requeued SLURM job {job} once its points had saved or ended") == 1, driver
    assert "(attempt 2): points 0, 1 of 4" in driver and "2 of 2 point(s) completed" in driver, driver

    sweep = tmp_path / "train" / "multiruns" / f"slurm-{array}"
    summarized = subprocess.run(
        [PYTHON, "scripts/summarize.py", str(sweep)], cwd=ROOT, capture_output=True, text=True
    )
    assert summarized.returncode == 0, summarized.stdout + summarized.stderr
    rows = _rows(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [(str(n), "completed") for n in range(4)], rows
    for number, row in enumerate(rows):
        run = Path(row["run_dir"])
        task = job if number < 2 else reference
        assert run == sweep / str(number) and row["slurm_log"] == str(
            tmp_path / f"myproject-pack-{task}.point{number}.out"
        )
        attempts = yaml.safe_load((run / "run.yaml").read_text())["attempts"]
        restarts = [0, 1] if number < 2 else [0]
        assert [a["slurm_restart_count"] for a in attempts] == restarts
        assert {a["slurm_job_id"] for a in attempts} == {task} and {a["world_size"] for a in attempts} == {1}
        cost = yaml.safe_load((run / "outcome.yaml").read_text())["cost"]
        assert [a["ended"] for a in cost["attempts"]] == (
            ["requeued", "completed"] if number < 2 else ["completed"]
        )

    for resumed, uninterrupted in ((0, 2), (1, 3)):
        run, same = sweep / str(resumed), sweep / str(uninterrupted)
        requeue_ckpt = run / "checkpoints" / "requeue.ckpt"
        assert f"starting from {requeue_ckpt} (restart 1 of this job)" in output(job, resumed)
        loops = torch.load(requeue_ckpt, map_location="cpu", weights_only=True)["loops"]["fit_loop"]
        assert 0 < loops["epoch_loop.batch_progress"]["current"]["processed"] < 158  # saved mid-epoch
        final, expected = (
            torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
            for d in (run, same)
        )
        assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
        assert metrics_without_timing(run) == metrics_without_timing(same)
