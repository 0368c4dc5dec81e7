"""Where and how this process was launched: by which launcher, as which rank, in which SLURM job, array
task, packed point and attempt, on which node, and the run id every rank derives from that.

Launchers, in the order they are recognised:
  torchrun     -- torchrun / torch.distributed.run started every process (RANK, LOCAL_WORLD_SIZE, ...)
  slurm        -- an `srun` step of a SLURM job started every process (SLURM_STEP_ID, SLURM_PROCID, ...)
  slurm-batch  -- python runs in the sbatch script (or salloc shell) itself, outside any srun step
  child        -- a process that Lightning's local launcher started for local rank > 0
  local        -- a plain `python src/train.py`; Lightning starts the other local ranks itself
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from hpctrain.runtime.environment.variables import variables

TORCHRUN, SLURM, SLURM_BATCH, CHILD, LOCAL = "torchrun", "slurm", "slurm-batch", "child", "local"


def launcher(env: Mapping[str, str] | None = None) -> str:
    """Who started this process (see the module docstring)."""
    env = variables(env)
    if all(key in env for key in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")):
        return TORCHRUN
    if "SLURM_JOB_ID" in env:
        return SLURM if "SLURM_STEP_ID" in env else SLURM_BATCH
    if env.get("LOCAL_RANK", "0") != "0":
        return CHILD
    return LOCAL


def is_rank_zero(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0, decided from the environment alone (before torch)."""
    return global_rank(env) == 0


def global_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher set it (0 for a plain process)."""
    env = variables(env)
    kind = launcher(env)
    if kind == TORCHRUN:
        return int(env["RANK"])
    if kind == SLURM:
        return int(env.get("SLURM_PROCID", "0"))
    if "RANK" in env:
        return int(env["RANK"])
    # Lightning's local launcher on node NODE_RANK: its ranks come after those of the nodes before it.
    local_rank, node_rank = int(env.get("LOCAL_RANK", "0")), int(env.get("NODE_RANK", "0"))
    return node_rank * int(env.get("LOCAL_WORLD_SIZE", "1")) + local_rank


def processes_started(env: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started for this job: torchrun's workers, an srun step's tasks,
    else 1 (a plain process; Lightning's local launcher starts the other ranks later, from the trainer)."""
    env = variables(env)
    kind = launcher(env)
    if kind == TORCHRUN:
        return int(env.get("WORLD_SIZE") or env["LOCAL_WORLD_SIZE"])
    if kind == SLURM:
        return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    return 1


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id `scontrol requeue` takes: `<array job>_<task>` for array jobs, else the job id."""
    env = variables(env)
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def array_task(env: Mapping[str, str] | None = None) -> tuple[int, int | None, str, str]:
    """This job array task's index, the array's number of tasks (None outside an array), and its first
    and last index as SLURM names them (`0` and `?` outside an array)."""
    env = variables(env)
    count = env.get("SLURM_ARRAY_TASK_COUNT")
    return (
        int(env.get("SLURM_ARRAY_TASK_ID", "0")),
        int(count) if count is not None else None,
        env.get("SLURM_ARRAY_TASK_MIN", "0"),
        env.get("SLURM_ARRAY_TASK_MAX", "?"),
    )


def slurm_ids(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The job's ids as SLURM gives them: the job's own, and an array task's array job and task (None
    outside SLURM, or outside an array)."""
    env = variables(env)
    return {
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "slurm_array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
    }


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times SLURM has requeued and restarted this job (0 on the first attempt)."""
    return int(variables(env).get("SLURM_RESTART_COUNT", "0") or 0)


def torchrun_restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun's agent has restarted the workers (0 on the first attempt)."""
    return int(variables(env).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _torchrun_agent_id(env: Mapping[str, str]) -> str | None:
    """An id of this node's torchrun agent, shared by its workers: the name of its log directory
    (TORCHELASTIC_ERROR_FILE=/tmp/torchelastic_<random>/<run id>_<random>/attempt_N/<rank>/error.json)."""
    error_file = env.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return None
    parts = Path(error_file).parts
    return next((part for part in parts if part.startswith("torchelastic_")), None)


def run_id(env: Mapping[str, str] | None = None, now: float | None = None) -> str:
    """A name for the run dir that every rank computes alike and a requeued job computes again.

    Under SLURM it is the job id (plus the step for a second srun in one job, or the point of a packed
    job), so a requeued job finds its checkpoint; under torchrun the rendezvous id (`--rdzv-id`; with the default id `none` on
    one node, the id of the node's torchrun agent); otherwise a timestamp.
    """
    env = variables(env)
    kind = launcher(env)
    if kind == TORCHRUN:
        rdzv = env.get("TORCHELASTIC_RUN_ID", "none")
        if rdzv == "none" and (agent := _torchrun_agent_id(env)) and env.get("GROUP_WORLD_SIZE", "1") == "1":
            return f"torchrun-{agent.removeprefix('torchelastic_')}"
        return f"torchrun-{rdzv}"
    if kind == SLURM and (point := pack_point(env)) is not None:  # its own step number changes per attempt
        return f"slurm-{slurm_job_id(env)}-point{point}"
    if kind in (SLURM, SLURM_BATCH):
        step = env.get("SLURM_STEP_ID", "0")
        suffix = "" if step in ("0", "batch") or kind == SLURM_BATCH else f".{step}"
        return f"slurm-{slurm_job_id(env)}{suffix}"
    now = time.time() if now is None else now
    # milliseconds: two runs started in the same second must not share (and resume from) one run dir
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


PACK_POINT = "HPCTRAIN_PACK_POINT"  # set by a packed job's driver for each point: its job number in the grid


POINT_LOG = "HPCTRAIN_POINT_LOG"  # ... and the file its output goes to


def pack_point(env: Mapping[str, str] | None = None) -> int | None:
    """The sweep point this process runs as one of several in a packed job's allocation (None otherwise).
    Such a point never requeues the job itself: `scontrol requeue` would requeue its neighbours too."""
    named = variables(env).get(PACK_POINT)
    return int(named) if named not in (None, "") else None


def resumed_sweep_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The multirun dir a job array re-runs the missing points of (scripts/submit.py --sweep with
    skip_completed=true sets HPCTRAIN_SWEEP_DIR; its task ids are then the grid's job numbers)."""
    named = variables(env).get("HPCTRAIN_SWEEP_DIR")
    return Path(named) if named else None


def project_root(code_root: Path, env: Mapping[str, str] | None = None) -> Path:
    """The project whose logs/, data/ and .venv a run uses: HPCTRAIN_PROJECT_ROOT when the code runs from
    a snapshot (hpctrain.runtime.snapshot; scripts/submit.py sets it), else where the code is."""
    named = variables(env).get("HPCTRAIN_PROJECT_ROOT")
    return Path(named).resolve() if named else code_root


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This node's name as SLURM knows it (several slurmd may share a host), else the hostname."""
    return variables(env).get("SLURMD_NODENAME") or socket.gethostname()


def process_is_gone(host: str, pid: str) -> bool:
    """Whether process `pid` of `host` has ended: only a process of this host can be asked, and one this
    user may not signal, or this very process, counts as running (its files are not to be taken)."""
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
