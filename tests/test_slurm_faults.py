"""Faults on the real two-node Slurm cluster: a rank that dies or raises ends the job at once, naming
it; a request that can never start is refused by scripts/submit.py before it pends forever. (Every
logger in a 2-node job, with no secret written anywhere: test_slurm.py's two-node job.)"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import PYTHON, ROOT
from tests.test_faults import flaky_model
from tests.test_slurm import CPU_JOB, SBATCH_FILE, _output, _submit

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

QUICK = (
    "trainer=ddp_cpu",
    "experiment=quickstart",
    "data.batch_size=8",
    "callbacks.progress.log_every_n_s=0",
    "extras.print_config=false",
)


def _rank_process(job: str, rank: int) -> psutil.Process | None:
    for process in psutil.process_iter(["cmdline"]):
        try:
            env = process.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if (
            env.get("SLURM_JOB_ID") == job
            and env.get("SLURM_PROCID") == str(rank)
            and "src/train.py" in " ".join(process.info["cmdline"] or [])
        ):
            return process
    return None


def test_a_killed_rank_ends_the_two_node_job(slurm_cluster, tmp_path: Path):
    job = _submit(slurm_cluster, tmp_path, *CPU_JOB, SBATCH_FILE, *QUICK, f"paths.log_dir={tmp_path}")
    deadline = time.monotonic() + 180
    while "epoch 0/25  step 20/" not in _output(tmp_path, job):
        assert time.monotonic() < deadline, _output(tmp_path, job)[-3000:]
        time.sleep(0.2)
    victim = _rank_process(job, 1)
    assert victim is not None
    victim.kill()
    killed_at = time.monotonic()
    info = slurm_cluster.wait(job, timeout_s=120)
    assert info["JobState"] == "FAILED" and time.monotonic() - killed_at < 60
    assert "node2: task 1: Killed" in _output(tmp_path, job)  # srun names the task (= rank 1)


def test_an_exception_in_one_rank_ends_the_two_node_job_naming_it(slurm_cluster, tmp_path: Path):
    args, env = flaky_model(tmp_path)
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        f"--export=ALL,PYTHONPATH={env['PYTHONPATH']}",
        *CPU_JOB,
        SBATCH_FILE,
        *args,
        *QUICK,
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    info = slurm_cluster.wait(job, timeout_s=180)
    output = _output(tmp_path, job)
    assert info["JobState"] == "FAILED", output[-3000:]
    assert "error: rank 1 on " in output and "failed: RuntimeError: injected failure on one rank" in output


def test_submit_refuses_what_can_never_start(slurm_cluster, tmp_path: Path):
    def submit(*args: str) -> str:
        result = slurm_cluster.run(
            PYTHON, "scripts/submit.py", *args, "--", "experiment=quickstart", cwd=ROOT
        )
        assert result.returncode == 2, result.stdout + result.stderr
        return result.stderr.strip()

    assert "--cpus-per-task=32 x --ntasks-per-node=1 needs 32 cores" in submit(
        "--nodes", "2", "--cpu", "--cpus-per-task", "32"
    )
    assert "partition debug has no GPUs; pass --cpu" in submit("--nodes", "1", "--gpus-per-node", "8")
    assert "--nodes=3 but partition debug has 2 node(s)" in submit("--nodes", "3", "--cpu")
    assert "--mem=64G per node" in submit("--nodes", "1", "--cpu", "--mem", "64G")
