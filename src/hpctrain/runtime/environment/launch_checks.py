"""Whether the launcher will start exactly the processes the trainer config expects (`preflight`), and
whether a one-process task (export) runs as one process (`preflight_one_process`).

Both answer in milliseconds, before torch, Lightning or any process group: a mismatch is one sentence and
an exit, never a hang in "Initializing distributed".
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from hpctrain.runtime.environment import devices as gpu_devices
from hpctrain.runtime.environment.allocated import GPU_ACCELERATORS, devices_asked, visible_gpus
from hpctrain.runtime.environment.cuda import check_cuda_build, check_gpu_architectures
from hpctrain.runtime.environment.launched import (
    CHILD,
    SLURM,
    SLURM_BATCH,
    TORCHRUN,
    launcher,
    processes_started,
)
from hpctrain.runtime.environment.variables import int_or_none, variables
from hpctrain.runtime.errors import UserError


def preflight(
    num_nodes: object,
    devices: object,
    accelerator: object,
    requeue_enabled: bool = False,
    env: Mapping[str, str] | None = None,
    backend: str | None = None,
) -> None:
    """Check that the launcher will start exactly the processes the trainer config expects.
    `backend`: dist.backend (None: the strategy's own, nccl on GPUs).

    Raises UserError with one sentence naming both values and the fix.
    """
    env = variables(env)
    kind = launcher(env)
    nodes, per_node = int_or_none(num_nodes), int_or_none(devices)
    accelerator = str(accelerator).lower()
    if kind == CHILD:
        return
    if kind == TORCHRUN:
        _check_torchrun(env, nodes, per_node)
    elif kind == SLURM:
        _check_slurm_step(env, nodes, per_node)
        if requeue_enabled and shutil.which("scontrol") is None:
            raise UserError(
                "scontrol is not on PATH inside the job, so it cannot requeue itself when its time runs out; "
                "make scontrol available (e.g. bind-mount it into the container) or pass requeue.enabled=false."
            )
    elif kind == SLURM_BATCH:
        _check_slurm_batch(env, nodes, per_node)
    elif nodes is not None and nodes > 1 and not ("MASTER_ADDR" in env and "NODE_RANK" in env):
        raise UserError(
            f"trainer.num_nodes={nodes} needs a launcher that starts processes on every node, but this is a "
            "plain python process on one machine; submit with `sbatch --nodes="
            f"{nodes} slurm/train.sbatch` (or use torchrun --nnodes={nodes}), or pass trainer.num_nodes=1."
        )
    if accelerator in GPU_ACCELERATORS:
        _check_gpus(env, per_node, kind)
        if backend != "gloo":  # gloo's ranks may share a GPU; NCCL's may not
            _check_tasks_have_gpus_of_their_own(env, kind)
        visible = visible_gpus(env)
        check_cuda_build(visible)
        if visible != 0:
            check_gpu_architectures(gpu_devices.visible_gpus(env))


def preflight_one_process(
    task: str, num_nodes: object, devices: object, env: Mapping[str, str] | None = None
) -> None:
    """Refuse to run `task` (export) as more than one process: it writes one file, and every further
    process would write it again, at the same time. Before `preflight`, whose advice is for training."""
    env = variables(env)
    started = processes_started(env)
    if started > 1:
        kind = "torchrun workers" if launcher(env) == TORCHRUN else "tasks of this SLURM step"
        raise UserError(
            f"{task} runs in one process, but this is one of {started} {kind}; start it once: "
            f"python src/{task}.py ... (under SLURM: srun --ntasks=1, or in the batch script itself)."
        )
    nodes, per_node = int_or_none(num_nodes) or 1, devices_asked(devices)
    if per_node is None or nodes * per_node > 1:
        asked = "one per device" if per_node is None else str(nodes * per_node)
        raise UserError(
            f"{task} runs in one process, but trainer.num_nodes={num_nodes} and trainer.devices={devices} "
            f"ask for {asked}; pass trainer.num_nodes=1 trainer.devices=1 (or leave both out)."
        )


def _check_torchrun(env: Mapping[str, str], nodes: int | None, per_node: int | None) -> None:
    local_world = int(env["LOCAL_WORLD_SIZE"])
    groups = int_or_none(env.get("GROUP_WORLD_SIZE"))
    if per_node is not None and per_node != local_world:
        raise UserError(
            f"trainer.devices={per_node} but torchrun starts {local_world} processes per node "
            f"(--nproc-per-node={local_world}); pass trainer.devices={local_world} or run torchrun "
            f"with --nproc-per-node={per_node}."
        )
    if nodes is not None and groups is not None and nodes != groups:
        raise UserError(
            f"trainer.num_nodes={nodes} but torchrun runs on {groups} node(s) (--nnodes={groups}); "
            f"pass trainer.num_nodes={groups} or run torchrun with --nnodes={nodes}."
        )


def _check_slurm_batch(env: Mapping[str, str], nodes: int | None, per_node: int | None) -> None:
    tasks = int_or_none(env.get("SLURM_NTASKS")) or 1
    wanted = (nodes or 1) * (per_node or 1)
    if tasks > 1 or wanted > 1:
        raise UserError(
            "python runs in the sbatch script itself, not in an srun step, so DDP would wait forever for "
            f"the other {max(tasks, wanted) - 1} process(es); launch it as `srun python src/train.py ...` "
            "(slurm/train.sbatch does), or from salloc as `srun python src/train.py ...`."
        )


def _check_slurm_step(env: Mapping[str, str], nodes: int | None, per_node: int | None) -> None:
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    slurm_nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    tasks_per_node = int_or_none(env.get("SLURM_NTASKS_PER_NODE"))
    if tasks_per_node is None:
        if tasks == 1 and (nodes or 1) * (per_node or 1) == 1:
            return
        raise UserError(
            f"the SLURM job has {tasks} task(s) but no --ntasks-per-node, so Slurm may place them unevenly "
            f"and trainer.devices cannot match every node; submit with --ntasks-per-node={per_node or 1} "
            "(one task per device) instead of --ntasks."
        )
    if nodes is not None and nodes != slurm_nodes:
        raise UserError(
            f"trainer.num_nodes={nodes} but the SLURM job has {slurm_nodes} node(s) (--nodes={slurm_nodes}); "
            f"submit with --nodes={nodes} or pass trainer.num_nodes={slurm_nodes}."
        )
    if per_node is not None and per_node != tasks_per_node:
        raise UserError(
            f"trainer.devices={per_node} but SLURM gives {tasks_per_node} task(s) per node "
            f"(--ntasks-per-node={tasks_per_node}); submit with --ntasks-per-node={per_node} "
            f"or pass trainer.devices={tasks_per_node}."
        )
    if tasks != slurm_nodes * tasks_per_node:
        raise UserError(
            f"the SLURM step has {tasks} task(s) but --nodes={slurm_nodes} x --ntasks-per-node={tasks_per_node} "
            f"is {slurm_nodes * tasks_per_node}; drop --ntasks and keep --nodes with --ntasks-per-node."
        )


def _job_gpus_here(env: Mapping[str, str]) -> tuple[int, str] | None:
    """The GPUs the job (or this step) holds on this node as Slurm says, and the variable that says it."""
    for name in ("SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS"):
        value = env.get(name, "").strip()
        if not value:
            continue
        count = int_or_none(value) if name == "SLURM_GPUS_ON_NODE" else len(value.split(","))
        if count is not None:
            return count, f"{name}={value}"
    return None


def _check_tasks_have_gpus_of_their_own(env: Mapping[str, str], kind: str) -> None:
    """Under SLURM, fewer GPUs on the node than tasks on it: ranks would share a GPU, which NCCL refuses
    at the first collective ("Duplicate GPU detected") after every rank has imported and built."""
    tasks = int_or_none((env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0])
    held = _job_gpus_here(env)
    if kind != SLURM or tasks is None or held is None or held[0] >= tasks:
        return
    gpus, said = held
    raise UserError(
        f"trainer.accelerator=gpu with {tasks} tasks per node (--ntasks-per-node={tasks}), but the job holds "
        f"{gpus} GPU(s) on this node ({said}), so ranks would share a GPU, which NCCL refuses ('Duplicate GPU "
        f"detected'); request one GPU per task (--gres=gpu:{tasks} or --gpus-per-task=1) or submit with "
        f"--ntasks-per-node={max(gpus, 1)}."
    )


def _check_gpus(env: Mapping[str, str], devices: int | None, kind: str) -> None:
    """`devices` None: auto, which needs at least one GPU."""
    visible = visible_gpus(env)
    per_node = devices if devices is not None else 1
    if visible is None or visible >= per_node:
        return
    shown = f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}"
    if visible == 0:
        raise UserError(
            f"trainer.accelerator=gpu with trainer.devices={devices or 'auto'} but this process sees no GPU "
            f"({shown}); request GPUs (e.g. --gres=gpu:{per_node}) or train on CPU with trainer=ddp_cpu."
        )
    if kind == SLURM and visible == 1:
        return  # one GPU bound to each task: the process uses it (see one_gpu_per_task)
    if kind == SLURM:
        raise UserError(
            f"trainer.devices={per_node} (tasks per node) but this process sees {visible} GPU(s) ({shown}), so "
            f"tasks cannot be matched to GPUs; give every task all of its node's GPUs (--gres=gpu:{per_node}) "
            "or exactly one (--gpus-per-task=1)."
        )
    raise UserError(
        f"trainer.devices={per_node} but this process sees only {visible} GPU(s) ({shown}); "
        f"make {per_node} GPUs visible or pass trainer.devices={visible}."
    )
