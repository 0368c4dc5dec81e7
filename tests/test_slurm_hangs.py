"""On the real two-node Slurm cluster: scripts/stacks.py reaches every task of a job by its id, and
scripts/doctor.py checks an allocation, naming the node where a check fails."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.differential.cases import user_overrides
from tests.helpers import PYTHON, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

CPU_JOB = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=2G", "--gres=none")


def _output(out_dir: Path, job: str) -> str:
    files = list(out_dir.glob(f"*-{job}.out"))
    return files[0].read_text() if files else ""


def test_stacks_reaches_every_rank_of_a_two_node_job_by_its_id(slurm_cluster, tmp_path: Path):
    mark = tmp_path / "asleep"
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        *CPU_JOB,
        "slurm/train.sbatch",
        "trainer=ddp_cpu",
        *user_overrides("SleepyRank"),
        "trainer.max_epochs=1",
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
        env={
            "PYTHONPATH": str(ROOT),
            "SLEEP_RANK": "1",
            "SLEEP_AT_STEP": "3",
            "SLEEP_S": "120",
            "SLEEP_MARK": str(mark),
        },
    )
    try:
        deadline = time.monotonic() + 180
        while not mark.exists():
            assert time.monotonic() < deadline, _output(tmp_path, job)[-3000:]
            assert slurm_cluster.job(job).get("JobState") != "FAILED", _output(tmp_path, job)[-3000:]
            time.sleep(0.5)
        time.sleep(1)
        shown = slurm_cluster.run(
            PYTHON, "scripts/stacks.py", job, "--log-dir", str(tmp_path), "--wait", "3", cwd=ROOT
        )
    finally:
        slurm_cluster.run("scancel", job)
    assert shown.returncode == 0, shown.stderr
    source = (ROOT / "tests" / "differential" / "user_code.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if 'time.sleep(float(os.environ["SLEEP_S"]))' in text)
    assert f"rank 1: training_step at user_code.py:{line}" in shown.stdout, shown.stdout
    assert "rank 0: " in shown.stdout and "did not answer" not in shown.stdout, shown.stdout
    assert "Traceback" not in _output(tmp_path, job)  # the signal ended nothing: loader workers ignore it


def _doctor(cluster, out_dir: Path, *overrides: str) -> tuple[dict[str, str], str]:
    job = cluster.sbatch(
        f"--output={out_dir}/%x-%j.out",
        *CPU_JOB,
        f"--wrap=srun {PYTHON} scripts/doctor.py {' '.join(overrides)}",
        cwd=ROOT,
    )
    info = cluster.wait(job, timeout_s=180)
    return info, _output(out_dir, job)


def test_doctor_passes_on_the_healthy_cluster(slurm_cluster, tmp_path: Path):
    (tmp_path / "data").mkdir()
    info, output = _doctor(
        slurm_cluster, tmp_path, f"paths.log_dir={tmp_path}/logs", f"paths.data_dir={tmp_path}/data"
    )
    assert info["JobState"] == "COMPLETED", output[-3000:]
    assert "2 task(s) on 2 node(s) (the process group came up across all of them)" in output
    for node in ("node1", "node2"):
        assert f"log dir writable                 {node}" in output
    assert "bus bandwidth" in output and "FAIL" not in output


def test_doctor_fails_naming_the_node_whose_log_dir_is_blocked(slurm_cluster, tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "node2").write_text(
        "a file where node2's log dir must be"
    )  # mode bits do not stop root
    info, output = _doctor(
        slurm_cluster,
        tmp_path,
        f"'paths.log_dir={tmp_path}/logs/${{oc.env:SLURMD_NODENAME}}'",
        f"paths.data_dir={tmp_path}/data",
    )
    assert info["JobState"] == "FAILED", output[-3000:]
    assert "error: 1 check(s) failed: log dir writable on node2" in output, output[-3000:]
