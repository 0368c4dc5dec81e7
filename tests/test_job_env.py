"""The job's setup lines (slurm/job_env.sh, their one home), read from the files and run by bash, without
Slurm (what the tasks then see is the local cluster's tests'): every job's srun gets the job's
--cpus-per-task (srun of Slurm 22.05 and later no longer takes it from the job), and rank 0's port is the
job's own, derived from its id."""

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


def _sourced(extra: dict[str, str], name: str = "SRUN_CPUS_PER_TASK", port: str | None = "29500") -> str:
    """`name` as a command after `source slurm/job_env.sh` sees it (`set -u` as the batch files run;
    MASTER_ADDR given, so no scontrol is asked; MASTER_PORT given unless `port` is None)."""
    env = {k: v for k, v in local_env().items() if not k.startswith(("SRUN_", "SLURM_", "MASTER_"))}
    env.pop("HPCTRAIN_PACK_POINT", None)
    env.update({"MASTER_ADDR": "node1", **({"MASTER_PORT": port} if port else {}), **extra})
    result = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source slurm/job_env.sh; printenv {name} || echo unset"],
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


def _port(job: str, **extra: str) -> int:
    return int(_sourced({"SLURM_JOB_ID": job, **extra}, "MASTER_PORT", port=None))


def test_rank_0s_port_is_the_jobs_own_derived_from_its_id_in_every_task():
    """Every task of a job computes the same port, with nothing bound and released in between (another
    process could take such a port before rank 0 listens); jobs whose ids share their last four digits
    (Lightning's default, 15000 + those digits) get different ones; a packed job's points each their own;
    all below Linux's ephemeral ports; a MASTER_PORT set before stands."""
    assert _port("123456") == _port("123456") == 15000 + 123456 % 15000
    ids = ["4123456", "4133456", "4143456", "4123457"]  # the first three share their last four digits
    ports = [_port(job) for job in ids]
    assert len(set(ports)) == len(ids) and all(15000 <= p < 30000 < 32768 for p in ports)
    points = [_port("4123456", HPCTRAIN_PACK_POINT=str(point)) for point in range(16)]
    assert len(set(points)) == 16 and all(15000 <= p < 30000 for p in points)
    assert _sourced({"SLURM_JOB_ID": "123456"}, "MASTER_PORT", port="29999") == "29999"


def test_the_srun_torchrun_form_listens_on_the_jobs_port():
    """scripts/torchrun_command.py --srun: the rendezvous on $MASTER_PORT (the job's, from slurm/job_env.sh),
    not a fixed 29500 that two jobs sharing a first node would both take; --master-port still chooses."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "torchrun_command", ROOT / "scripts" / "torchrun_command.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    lines = tool.commands(tool.parse(["--nodes=2", "--srun", "--", "x=1"]))
    assert lines[0].startswith("source slurm/job_env.sh")
    assert '"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"' in lines[1] and "29500" not in lines[1]
    chosen = tool.commands(tool.parse(["--nodes=2", "--srun", "--master-port=23456", "--", "x=1"]))
    assert '"--rdzv-endpoint=$MASTER_ADDR:23456"' in chosen[1]
