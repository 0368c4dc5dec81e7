"""What SLURM says about this job, and what it is asked to do to it: `scontrol show job`'s fields (its
output file, its end time), `scontrol requeue`, `scancel --signal` to its steps, and `squeue` for
whether a submitted job is still queued."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Mapping

from hpctrain.runtime.environment.launched import POINT_LOG, pack_point, slurm_job_id
from hpctrain.runtime.environment.variables import variables


def slurm_output_file(env: Mapping[str, str] | None = None) -> str | None:
    """The file SLURM writes this job's output to (`scontrol show job`'s StdOut), or None outside SLURM;
    a point of a packed job: the file its driver writes the point's output to."""
    if pack_point(env) is not None and variables(env).get(POINT_LOG):
        return variables(env)[POINT_LOG]
    return (_job_fields(env) or {}).get("StdOut")


def _job_fields(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """`scontrol show job -o`'s fields for this job, or None outside SLURM (or without scontrol)."""
    job = slurm_job_id(env)
    if job is None or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def requeue_job(env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Ask SLURM to requeue this job; it restarts later with SLURM_RESTART_COUNT incremented."""
    job = slurm_job_id(env)
    if job is None:
        raise RuntimeError("requeue_job called outside a SLURM job")
    return subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)


def signal_steps(signal_name: str, env: Mapping[str, str] | None = None) -> None:
    """Send `signal_name` to every step of this job (not its batch script): a packed job's points."""
    job = slurm_job_id(env)
    if job is not None:
        subprocess.run(["scancel", f"--signal={signal_name}", job], capture_output=True, check=False)


def job_end_time(env: Mapping[str, str] | None = None) -> float | None:
    """When this job's time limit ends it (seconds since the epoch), or None (no limit, or unknown)."""
    fields = _job_fields(env)
    if fields is None:
        return None
    try:
        return time.mktime(time.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def in_queue(job: str) -> bool:
    """Whether SLURM still holds a task of job `job` (pending, running or requeued): what a launcher that
    submitted it waits on. True when squeue cannot tell (it is asked again)."""
    try:
        result = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return True
    if result.returncode != 0:
        return "invalid job id" not in result.stderr.lower()  # gone from the queue long enough to be unknown
    return bool(result.stdout.strip())
