"""What this process and its job were allocated: the GPUs it sees, the CPUs each process may use, and
the resources SLURM granted the job (recorded in run.yaml)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpctrain.runtime.environment.launched import SLURM, TORCHRUN, launcher
from hpctrain.runtime.environment.variables import int_or_none, variables

GPU_ACCELERATORS = ("gpu", "cuda")


def visible_gpus(env: Mapping[str, str] | None = None) -> int | None:
    """GPUs this process may use, from CUDA_VISIBLE_DEVICES; None when it cannot tell without torch."""
    env = variables(env)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not Path("/dev/nvidia0").exists() and not Path("/dev/nvidiactl").exists():
        return 0
    return None


def gpus_on_node(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """The GPUs a process started here would see: CUDA_VISIBLE_DEVICES's, else the NVIDIA device files."""
    if variables(env).get("CUDA_VISIBLE_DEVICES") is not None:
        return visible_gpus(env) or 0
    return len([p for p in dev.glob("nvidia*") if p.name[len("nvidia") :].isdigit()])


def cpus_per_process(
    devices: object,
    env: Mapping[str, str] | None = None,
    affinity: int | None = None,
    accelerator: object = "auto",
    dev: Path = Path("/dev"),
) -> tuple[int, str]:
    """The CPUs one process of this job may use, and how that was found: its affinity mask (where Slurm
    puts a task's --cpus-per-task), shared by the processes on this node that share the mask. Under
    Lightning's own launcher `devices: auto` (or -1) on GPUs starts one process per GPU, not one."""
    env = variables(env)
    cpus = affinity if affinity is not None else len(os.sched_getaffinity(0))
    kind = launcher(env)
    per_task = int_or_none(env.get("SLURM_CPUS_PER_TASK")) if kind == SLURM else None
    if per_task:  # a site without task/affinity leaves every task the whole node: --cpus-per-task says it
        return max(1, min(cpus, per_task)), f"SLURM --cpus-per-task={per_task}, {cpus} in the affinity mask"
    if kind == SLURM:
        sharing, who = int_or_none((env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0]), "task(s)"
    elif kind == TORCHRUN:
        sharing, who = int_or_none(env.get("LOCAL_WORLD_SIZE")), "torchrun worker(s)"
    else:
        sharing, who = devices_asked(devices), "process(es)"
        on_gpus = str(accelerator).lower() in (*GPU_ACCELERATORS, "auto")
        if (devices in ("auto", -1, "-1") or sharing is None) and on_gpus:
            sharing = gpus_on_node(env, dev) or 1  # one process per GPU (CPU only: one process)
    sharing = sharing or 1
    return max(1, cpus // sharing), f"{cpus} CPUs in the affinity mask / {sharing} {who} per node"


def devices_asked(devices: object) -> int | None:
    """Processes per node that trainer.devices asks for (None: one per device there is, -1)."""
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    if devices == "auto":
        return 1
    count = int_or_none(devices)
    return None if count == -1 else count


def one_gpu_per_task(env: Mapping[str, str] | None = None) -> bool:
    """Whether SLURM binds one GPU to each task (--gpus-per-task=1, --gpu-bind, or CUDA_VISIBLE_DEVICES
    set per task): each process sees exactly one GPU, whatever its SLURM_LOCALID."""
    env = variables(env)
    tasks_per_node = int_or_none(env.get("SLURM_NTASKS_PER_NODE")) or 1
    return launcher(env) == SLURM and visible_gpus(env) == 1 and tasks_per_node > 1


ALLOCATION = {  # what SLURM finally granted the job, as its environment says (recorded in run.yaml)
    "partition": "SLURM_JOB_PARTITION",
    "account": "SLURM_JOB_ACCOUNT",
    "qos": "SLURM_JOB_QOS",
    "nodes": "SLURM_JOB_NUM_NODES",
    "tasks_per_node": "SLURM_NTASKS_PER_NODE",
    "cpus_per_task": "SLURM_CPUS_PER_TASK",
    "mem_per_node_mb": "SLURM_MEM_PER_NODE",
    "gpus_on_node": "SLURM_GPUS_ON_NODE",
}


def allocation(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The SLURM job's granted resources (None outside SLURM)."""
    env = variables(env)
    if "SLURM_JOB_ID" not in env:
        return None
    return {key: env[var] for key, var in ALLOCATION.items() if env.get(var)}
