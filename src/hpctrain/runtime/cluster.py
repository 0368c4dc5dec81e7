"""How this process was launched, and whether that agrees with the trainer config.

Launchers, in the order they are recognised:
  torchrun     -- torchrun / torch.distributed.run started every process (RANK, LOCAL_WORLD_SIZE, ...)
  slurm        -- an `srun` step of a SLURM job started every process (SLURM_STEP_ID, SLURM_PROCID, ...)
  slurm-batch  -- python runs in the sbatch script (or salloc shell) itself, outside any srun step
  child        -- a process that Lightning's local launcher started for local rank > 0
  local        -- a plain `python src/train.py`; Lightning starts the other local ranks itself

This is the only module that reads cluster environment variables. It imports neither torch nor
Lightning, so `preflight` answers in milliseconds, before any heavy import or process group: a
mismatch is one sentence and an exit, never a hang in "Initializing distributed".
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.runtime.errors import UserError

TORCHRUN, SLURM, SLURM_BATCH, CHILD, LOCAL = "torchrun", "slurm", "slurm-batch", "child", "local"
GPU_ACCELERATORS = ("gpu", "cuda")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def launcher(env: Mapping[str, str] | None = None) -> str:
    """Who started this process (see the module docstring)."""
    env = _env(env)
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
    env = _env(env)
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


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id `scontrol requeue` takes: `<array job>_<task>` for array jobs, else the job id."""
    env = _env(env)
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def array_task(env: Mapping[str, str] | None = None) -> tuple[int, int | None, str, str]:
    """This job array task's index, the array's number of tasks (None outside an array), and its first
    and last index as SLURM names them (`0` and `?` outside an array)."""
    env = _env(env)
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
    env = _env(env)
    return {
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "slurm_array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
    }


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times SLURM has requeued and restarted this job (0 on the first attempt)."""
    return int(_env(env).get("SLURM_RESTART_COUNT", "0") or 0)


def torchrun_restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun's agent has restarted the workers (0 on the first attempt)."""
    return int(_env(env).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


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
    env = _env(env)
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


def _int_or_none(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def visible_gpus(env: Mapping[str, str] | None = None) -> int | None:
    """GPUs this process may use, from CUDA_VISIBLE_DEVICES; None when it cannot tell without torch."""
    env = _env(env)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not Path("/dev/nvidia0").exists() and not Path("/dev/nvidiactl").exists():
        return 0
    return None


def preflight(
    num_nodes: object,
    devices: object,
    accelerator: object,
    requeue_enabled: bool = False,
    env: Mapping[str, str] | None = None,
) -> None:
    """Check that the launcher will start exactly the processes the trainer config expects.

    Raises UserError with one sentence naming both values and the fix.
    """
    env = _env(env)
    kind = launcher(env)
    nodes, per_node = _int_or_none(num_nodes), _int_or_none(devices)
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
        check_cuda_build(visible_gpus(env))


def processes_started(env: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started for this job: torchrun's workers, an srun step's tasks,
    else 1 (a plain process; Lightning's local launcher starts the other ranks later, from the trainer)."""
    env = _env(env)
    kind = launcher(env)
    if kind == TORCHRUN:
        return int(env.get("WORLD_SIZE") or env["LOCAL_WORLD_SIZE"])
    if kind == SLURM:
        return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    return 1


def gpus_on_node(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """The GPUs a process started here would see: CUDA_VISIBLE_DEVICES's, else the NVIDIA device files."""
    if _env(env).get("CUDA_VISIBLE_DEVICES") is not None:
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
    env = _env(env)
    cpus = affinity if affinity is not None else len(os.sched_getaffinity(0))
    kind = launcher(env)
    per_task = _int_or_none(env.get("SLURM_CPUS_PER_TASK")) if kind == SLURM else None
    if per_task:  # a site without task/affinity leaves every task the whole node: --cpus-per-task says it
        return max(1, min(cpus, per_task)), f"SLURM --cpus-per-task={per_task}, {cpus} in the affinity mask"
    if kind == SLURM:
        sharing, who = _int_or_none((env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0]), "task(s)"
    elif kind == TORCHRUN:
        sharing, who = _int_or_none(env.get("LOCAL_WORLD_SIZE")), "torchrun worker(s)"
    else:
        sharing, who = _devices_asked(devices), "process(es)"
        on_gpus = str(accelerator).lower() in (*GPU_ACCELERATORS, "auto")
        if (devices in ("auto", -1, "-1") or sharing is None) and on_gpus:
            sharing = gpus_on_node(env, dev) or 1  # one process per GPU (CPU only: one process)
    sharing = sharing or 1
    return max(1, cpus // sharing), f"{cpus} CPUs in the affinity mask / {sharing} {who} per node"


def _devices_asked(devices: object) -> int | None:
    """Processes per node that trainer.devices asks for (None: one per device there is, -1)."""
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    if devices == "auto":
        return 1
    count = _int_or_none(devices)
    return None if count == -1 else count


def preflight_one_process(
    task: str, num_nodes: object, devices: object, env: Mapping[str, str] | None = None
) -> None:
    """Refuse to run `task` (export) as more than one process: it writes one file, and every further
    process would write it again, at the same time. Before `preflight`, whose advice is for training."""
    env = _env(env)
    started = processes_started(env)
    if started > 1:
        kind = "torchrun workers" if launcher(env) == TORCHRUN else "tasks of this SLURM step"
        raise UserError(
            f"{task} runs in one process, but this is one of {started} {kind}; start it once: "
            f"python src/{task}.py ... (under SLURM: srun --ntasks=1, or in the batch script itself)."
        )
    nodes, per_node = _int_or_none(num_nodes) or 1, _devices_asked(devices)
    if per_node is None or nodes * per_node > 1:
        asked = "one per device" if per_node is None else str(nodes * per_node)
        raise UserError(
            f"{task} runs in one process, but trainer.num_nodes={num_nodes} and trainer.devices={devices} "
            f"ask for {asked}; pass trainer.num_nodes=1 trainer.devices=1 (or leave both out)."
        )


def _check_torchrun(env: Mapping[str, str], nodes: int | None, per_node: int | None) -> None:
    local_world = int(env["LOCAL_WORLD_SIZE"])
    groups = _int_or_none(env.get("GROUP_WORLD_SIZE"))
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
    tasks = _int_or_none(env.get("SLURM_NTASKS")) or 1
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
    tasks_per_node = _int_or_none(env.get("SLURM_NTASKS_PER_NODE"))
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


def one_gpu_per_task(env: Mapping[str, str] | None = None) -> bool:
    """Whether SLURM binds one GPU to each task (--gpus-per-task=1, --gpu-bind, or CUDA_VISIBLE_DEVICES
    set per task): each process sees exactly one GPU, whatever its SLURM_LOCALID."""
    env = _env(env)
    tasks_per_node = _int_or_none(env.get("SLURM_NTASKS_PER_NODE")) or 1
    return launcher(env) == SLURM and visible_gpus(env) == 1 and tasks_per_node > 1


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


# ------------------------------------------------------------------ torch's CUDA build and the node's driver

# The oldest NVIDIA driver that runs a CUDA major release (NVIDIA's "CUDA Compatibility": minor version
# compatibility lets a build of any 13.x run on a >= 580 driver, of any 12.x on >= 525.60.13). A torch
# wheel carries its CUDA runtime; the node gives the driver.
MINIMUM_DRIVER = {13: "580", 12: "525.60.13", 11: "450.80.02"}
# PyTorch's builds of the lock's torch that `make install CUDA=<variant>` installs (from PyTorch's index)
CUDA_VARIANTS = ("cu126", "cu128", "cu130", "cpu")
DRIVER_FILE = Path("/proc/driver/nvidia/version")


def torch_build() -> tuple[str, str | None] | None:
    """The installed torch's version and the CUDA it was built for (None: a CPU build), read from its
    version.py without importing torch; None without torch."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec else []
        text = (Path(folders[0]) / "version.py").read_text() if folders else ""
    except (ImportError, OSError, ValueError):
        return None
    version = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:['\"]([^'\"]*)['\"]|None)", text, re.M)
    if version is None or cuda is None:
        return None
    return version.group(1), cuda.group(1) or None


def driver_version(path: Path = DRIVER_FILE) -> str | None:
    """This node's NVIDIA kernel driver, e.g. 535.104.05 (None without one)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def driver_needed(cuda: str) -> str | None:
    """The oldest driver that runs CUDA `cuda` (e.g. 13.0 -> 580), None for a release not in the table."""
    major = _int_or_none(cuda.split(".")[0])
    return MINIMUM_DRIVER.get(major) if major is not None else None


def _older(version: str, than: str) -> bool:
    def numbers(v: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", v))

    return numbers(version) < numbers(than)


def _cuda_starts() -> bool:
    """Whether CUDA initialises in a fresh interpreter (this one stays free of torch); True when that
    cannot be told (a compatibility package may let an older driver run a newer CUDA)."""
    import sys

    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError):
        return True
    return result.returncode != 3


def check_cuda_build(
    visible: int | None,
    build: tuple[str, str | None] | None = None,
    driver: str | None = None,
    cuda_starts: Callable[[], bool] | None = None,
) -> None:
    """Refuse, in one sentence, a GPU run that CUDA cannot start: a CPU-only torch, or a torch built for a
    CUDA newer than the node's driver runs (checked by starting CUDA once, in a child process, only when
    the versions say it must fail). `build`, `driver`, `cuda_starts`: what to use instead of this node's."""
    if visible == 0:
        return
    build = build or torch_build()
    if build is None:
        return
    version, cuda = build
    if cuda is None:
        raise UserError(
            f"trainer.accelerator=gpu, but the installed torch {version} is a CPU-only build; install a CUDA "
            f"build (make install CUDA=cu126, or CUDA=cu130 where nvidia-smi shows a driver >= "
            f"{MINIMUM_DRIVER[13]}) or train on the CPU with trainer=cpu."
        )
    driver = driver or driver_version()
    needed = driver_needed(cuda)
    if driver is None or needed is None or not _older(driver, needed):
        return
    if (cuda_starts or _cuda_starts)():
        return
    if not _older(driver, MINIMUM_DRIVER[12]):
        fix = f"install torch's build for CUDA 12 (make install CUDA={CUDA_VARIANTS[0]}) or ask your site for a driver >= {needed}"
    else:
        fix = f"ask your site for a driver >= {needed} (no CUDA 12 or 13 build of torch runs on {driver})"
    raise UserError(
        f"torch {version} is built for CUDA {cuda}, which needs an NVIDIA driver >= {needed}, but this node's "
        f"driver is {driver} and CUDA does not start; {fix}."
    )


def network_summary(num_nodes: int, env: Mapping[str, str] | None = None, hostname: str | None = None) -> str:
    """One line saying where rank 0 listens and which interface each backend uses, with a warning when a
    multi-node job's gloo would use a loopback address (the others could not reach it: a silent wait)."""
    import socket

    env = _env(env)
    host = hostname or socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "unresolved"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        master = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    else:  # the template's local launcher picks a free port when it starts the other ranks
        where = "this machine" if num_nodes <= 1 else "the first node"
        master = f"{env.get('MASTER_ADDR') or where}, on a free port chosen when the ranks start"
    gloo = (
        f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}"
        if env.get("GLOO_SOCKET_IFNAME")
        else f"the address of {host} ({address})"
    )
    nccl = (
        f"NCCL_SOCKET_IFNAME={env['NCCL_SOCKET_IFNAME']}"
        if env.get("NCCL_SOCKET_IFNAME")
        else "its own choice (InfiniBand first, else a non-loopback interface)"
    )
    line = f"network: rank 0 at {master}; gloo uses {gloo}; nccl uses {nccl}"
    if num_nodes > 1 and not env.get("GLOO_SOCKET_IFNAME") and address.startswith("127."):
        line += (
            f"; warning: {host} resolves to {address}, a loopback address other nodes cannot reach: "
            "set GLOO_SOCKET_IFNAME (slurm/train.sbatch) unless every node is this machine"
        )
    return line


def slurm_output_file(env: Mapping[str, str] | None = None) -> str | None:
    """The file SLURM writes this job's output to (`scontrol show job`'s StdOut), or None outside SLURM;
    a point of a packed job: the file its driver writes the point's output to."""
    if pack_point(env) is not None and _env(env).get(POINT_LOG):
        return _env(env)[POINT_LOG]
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


FLIGHT_RECORDER_DIR = "flight_recorder"


def flight_recorder_dumps_into(run_dir: str | Path, env: MutableMapping[str, str] | None = None) -> None:
    """NCCL's flight recorder (the last collectives of each rank, written when a collective times out)
    writes into `<run dir>/flight_recorder/rank<N>`, unless the environment already says where. Set
    before the process group exists (NCCL reads it then); slurm/train.sbatch turns the recorder on."""
    env = os.environ if env is None else env
    if "TORCH_FR_DUMP_TEMP_FILE" not in env:
        folder = Path(run_dir) / FLIGHT_RECORDER_DIR
        folder.mkdir(parents=True, exist_ok=True)  # NCCL writes the files, not the folder
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{folder}/rank"


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This node's name as SLURM knows it (several slurmd may share a host), else the hostname."""
    import socket

    return _env(env).get("SLURMD_NODENAME") or socket.gethostname()


def project_root(code_root: Path, env: Mapping[str, str] | None = None) -> Path:
    """The project whose logs/, data/ and .venv a run uses: HPCTRAIN_PROJECT_ROOT when the code runs from
    a snapshot (hpctrain.runtime.snapshot; scripts/submit.py sets it), else where the code is."""
    named = _env(env).get("HPCTRAIN_PROJECT_ROOT")
    return Path(named).resolve() if named else code_root


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
    env = _env(env)
    if "SLURM_JOB_ID" not in env:
        return None
    return {key: env[var] for key, var in ALLOCATION.items() if env.get(var)}


def resumed_sweep_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The multirun dir a job array re-runs the missing points of (scripts/submit.py --sweep with
    skip_completed=true sets HPCTRAIN_SWEEP_DIR; its task ids are then the grid's job numbers)."""
    named = _env(env).get("HPCTRAIN_SWEEP_DIR")
    return Path(named) if named else None


# ------------------------------------------------------------------ packed jobs (hpctrain.runtime.sweeps.pack)

PACK_POINT = "HPCTRAIN_PACK_POINT"  # set by a packed job's driver for each point: its job number in the grid
POINT_LOG = "HPCTRAIN_POINT_LOG"  # ... and the file its output goes to


def pack_point(env: Mapping[str, str] | None = None) -> int | None:
    """The sweep point this process runs as one of several in a packed job's allocation (None otherwise).
    Such a point never requeues the job itself: `scontrol requeue` would requeue its neighbours too."""
    named = _env(env).get(PACK_POINT)
    return int(named) if named not in (None, "") else None


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
    env = _env(env)
    nodes = _int_or_none(env.get("SLURM_JOB_NUM_NODES")) or 1
    if nodes != 1:
        raise UserError(
            f"a packed job runs its points side by side on one node, but this job has {nodes} nodes; submit it "
            "with --nodes=1 (scripts/submit.py --sweep --pack N does), or run points that need several nodes "
            "as a job array (scripts/submit.py --sweep without --pack)."
        )
    tasks = _int_or_none((env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0]) or 1
    gpus = _int_or_none(env.get("SLURM_GPUS_ON_NODE")) or 0
    for what, count, flag in (("task(s)", tasks, "--ntasks-per-node"), ("GPU(s)", gpus, "--gres=gpu")):
        if count % points:
            raise UserError(
                f"--pack={points} shares the node between {points} points, but the job has {count} {what} on it "
                f"({flag}={count}), which {points} points cannot share evenly; submit with "
                f"{flag}={points * max(1, count // points)} (scripts/submit.py --sweep --pack {points} computes "
                "every count)."
            )
    memory = _int_or_none(env.get("SLURM_MEM_PER_NODE"))
    return PackShare(
        points=points,
        tasks=tasks // points,
        cpus_per_task=_int_or_none(env.get("SLURM_CPUS_PER_TASK")),
        memory_mb=memory // points if memory else None,
        gpus=gpus // points,
    )


def pack_step_env(
    share: PackShare, point: int, log: str | Path, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment under which slurm/train.sbatch runs one point of a packed job: its `srun` reads its
    flags from these variables (an `--exact` step of the point's share of the node), the trainer counts
    follow from them, the point is told it is packed, and its rank 0 finds a port of its own."""
    step = dict(_env(env))
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
        step["SRUN_CPUS_PER_TASK"] = str(
            share.cpus_per_task
        )  # srun does not take the job's since Slurm 22.05
    if share.memory_mb:
        step["SLURM_MEM_PER_NODE"] = str(share.memory_mb)
    if share.gpus:
        step["SLURM_STEP_GRES"] = f"gpu:{share.gpus}"
    return step


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
