"""How a packed job's one node is shared between the sweep points it runs side by side
(hpctrain.runtime.sweeps.pack is the driver), and the environment each point's `srun` step runs under."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpctrain.runtime.environment.launched import PACK_POINT, POINT_LOG
from hpctrain.runtime.environment.variables import int_or_none, variables
from hpctrain.runtime.errors import UserError


@dataclass(frozen=True)
class PackShare:
    """What each of a packed job's points gets of its one node: tasks (one per GPU, or processes on a CPU
    cluster), CPUs per task, memory (MB, None: the job did not say per node) and GPUs."""

    points: int
    tasks: int
    cpus_per_task: int | None
    memory_mb: int | None
    gpus: int

    def describe(self) -> str:
        cpus = f" x {self.cpus_per_task} CPU(s)" if self.cpus_per_task else ""
        memory = f", {self.memory_mb} MB" if self.memory_mb else ""
        gpus = f", {self.gpus} GPU(s)" if self.gpus else ""
        return f"{self.tasks} task(s){cpus}{memory}{gpus}"


def pack_share(points: int, env: Mapping[str, str] | None = None) -> PackShare:
    """Split this job's allocation (one node) evenly between `points` points; one sentence if it cannot be."""
    env = variables(env)
    nodes = int_or_none(env.get("SLURM_JOB_NUM_NODES")) or 1
    if nodes != 1:
        raise UserError(
            f"a packed job runs its points side by side on one node, but this job has {nodes} nodes; submit it "
            "with --nodes=1 (scripts/submit.py --sweep --pack N does), or run points that need several nodes "
            "as a job array (scripts/submit.py --sweep without --pack)."
        )
    tasks = int_or_none((env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0]) or 1
    gpus = int_or_none(env.get("SLURM_GPUS_ON_NODE")) or 0
    for what, count, flag in (("task(s)", tasks, "--ntasks-per-node"), ("GPU(s)", gpus, "--gres=gpu")):
        if count % points:
            raise UserError(
                f"--pack={points} shares the node between {points} points, but the job has {count} {what} on it "
                f"({flag}={count}), which {points} points cannot share evenly; submit with "
                f"{flag}={points * max(1, count // points)} (scripts/submit.py --sweep --pack {points} computes "
                "every count)."
            )
    memory = int_or_none(env.get("SLURM_MEM_PER_NODE"))
    return PackShare(
        points=points,
        tasks=tasks // points,
        cpus_per_task=int_or_none(env.get("SLURM_CPUS_PER_TASK")),
        memory_mb=memory // points if memory else None,
        gpus=gpus // points,
    )


def pack_step_env(
    share: PackShare, point: int, log: str | Path, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment under which slurm/train.sbatch runs one point of a packed job: its `srun` reads its
    flags from these variables (an `--exact` step of the point's share of the node), the trainer counts
    follow from them, the point is told it is packed, and its rank 0 finds a port of its own."""
    step = dict(variables(env))
    for name in ("MASTER_PORT", "SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GRES"):
        step.pop(name, None)  # the job's, which would give every point all of them
    step.update(
        {
            "SLURM_EXACT": "1",
            "SLURM_NNODES": "1",
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_NTASKS": str(share.tasks),
            "SLURM_NPROCS": str(share.tasks),
            "SLURM_NTASKS_PER_NODE": str(share.tasks),
            PACK_POINT: str(point),
            POINT_LOG: str(log),
        }
    )
    if share.cpus_per_task:
        # srun does not take the job's since Slurm 22.05
        step["SRUN_CPUS_PER_TASK"] = str(share.cpus_per_task)
    if share.memory_mb:
        step["SLURM_MEM_PER_NODE"] = str(share.memory_mb)
    if share.gpus:
        step["SLURM_STEP_GRES"] = f"gpu:{share.gpus}"
    return step
