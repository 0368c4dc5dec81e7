"""Every job's srun gets the job's --cpus-per-task: srun of Slurm 22.05 and later no longer takes it from the
job, so each batch file's setup lines (slurm/job_env.sh, their one home) export SRUN_CPUS_PER_TASK. Read
from the files and run by bash, without Slurm (what the tasks then see is the local cluster's tests')."""

from __future__ import annotations

import re
import subprocess

import pytest

from hpctrain.runtime.sweeps.slurm import setup_lines
from tests.helpers import ROOT, local_env

SLURM = ROOT / "slurm"


@pytest.mark.parametrize("batch_file", sorted(p.name for p in SLURM.glob("*.sbatch")))
def test_every_batch_file_runs_the_job_setup_lines_before_its_srun(batch_file: str):
    text = (SLURM / batch_file).read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    sourced = re.search(r"^source slurm/job_env\.sh\b", code, re.M)
    through = re.search(r"^exec bash slurm/train\.sbatch\b", code, re.M)  # sweep.sbatch: a point of its grid
    assert sourced or through, f"slurm/{batch_file} neither sources slurm/job_env.sh nor runs train.sbatch"
    if sourced and "srun" in code:
        assert sourced.start() < code.index("srun"), f"slurm/{batch_file}: srun before the setup lines"


def test_the_slurm_launchers_jobs_run_them_too():
    assert any(line.startswith("source ") and line.endswith("slurm/job_env.sh") for line in setup_lines("."))


def _sourced(extra: dict[str, str]) -> str:
    """SRUN_CPUS_PER_TASK as a command after `source slurm/job_env.sh` sees it (`set -u` as the batch
    files run; MASTER_ADDR and MASTER_PORT given, so no scontrol is asked)."""
    env = {k: v for k, v in local_env().items() if not k.startswith("SRUN_")}
    env.update({"MASTER_ADDR": "node1", "MASTER_PORT": "29500", **extra})
    result = subprocess.run(
        [
            "bash",
            "-c",
            "set -euo pipefail; source slurm/job_env.sh; printenv SRUN_CPUS_PER_TASK || echo unset",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_the_setup_lines_export_the_jobs_cpus_per_task_to_srun():
    assert _sourced({"SLURM_CPUS_PER_TASK": "6"}) == "6"
    # a value set before stands: a packed job's share of the node, a site's own
    assert _sourced({"SLURM_CPUS_PER_TASK": "6", "SRUN_CPUS_PER_TASK": "3"}) == "3"
    # a job without --cpus-per-task leaves srun to its defaults
    assert _sourced({}) == "unset"
