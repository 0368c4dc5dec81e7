"""What only a GPU node can show, before the first big job: python scripts/gpu_checks.py [--budget S]

    python scripts/gpu_checks.py --budget 480             # one GPU: the one-GPU set, in under 8 minutes
    python scripts/gpu_checks.py                          # 2+ GPUs: the multi-GPU checks too
    python scripts/gpu_checks.py --only nccl_hang_named fsdp2 --timeout 900
    python scripts/gpu_checks.py --list                   # the checks, one line each

Each check runs in a process of its own under a time limit (its own, `--timeout`, and what is left of
`--budget`, the whole tool's deadline): a hang becomes a row "timed out after N s" (the stuck training
run's stacks written first, to its run dir's stacks/), never a hung tool. The results go to
<out>/gpu_checks.json after every check (a check still running is marked so), so a crash or a hang of
the node loses nothing; the table is printed and saved beside it (gpu_checks.txt), with a dated report
(<date>-gpu-checks.md: the node, its GPUs and software, every row); each check's output and training
runs are in <out>/<check>/. Nothing is skipped silently: a check this node cannot run (no GPU, fewer
GPUs than it needs, the budget spent) is a row "not run" saying why, and the exit status tells:

    0  every check ran and passed          1  a check failed or timed out
    3  partial: every check that ran passed, some could not run here      2  a bad argument

The output dir defaults to logs/gpu_checks/<date>_<time>/; send that folder back when a check fails.

The checks (what each shows that a CPU cannot), the one-GPU set first:
  environment        torch, its CUDA build, the node's driver, the GPUs, the CPUs (always runs)
  cuda_driver        torch's CUDA build runs on this driver and every GPU's architecture (a matmul on each)
  bf16               native bfloat16, or the run says once that it is emulated (Volta, Turing)
  precisions         fit and test in 32-true, 16-mixed, bf16-mixed and bf16-true
  sync_points        the host's waits for the GPU in 10 training steps, counted per step and judged
  mfu                a compute-bound Transformer in bf16: FLOP/s and MFU from the template's own count
                     (no profiler), judged against a floor; NVML's columns
  ddp_nccl           DDP over nccl on every GPU here (one: a process group of one)
  flight_recorder    NCCL's flight record of a process group of one, written by hpctrain's dump and read
                     back by torch's reader
  fsdp2              FSDP2 in bf16 on every GPU here with the character Transformer's text sample on, fit
                     and test, then a resume of its sharded checkpoint on half the GPUs (or the one)
  async_dcp          FSDP2's asynchronous sharded save (torch.distributed.checkpoint): committed whole,
                     read back, resumed
  two_tasks_one_gpu  2 tasks as Slurm starts them, sharing one GPU over gloo: the launch logic, fit, test
  watchdog           2 tasks sharing one GPU over gloo, rank 1 stuck: the watchdog names it before the
                     collective timeout, and every rank writes its flight record
  one_gpu_per_task   2 tasks as Slurm starts them with --gpus-per-task=1: training and scripts/doctor.py
  nccl_hang_named    rank 1 stuck past the collective timeout on nccl: the sentence names rank 1, and NCCL's
                     flight recorder leaves dumps that torch's reader reads
  tensor_parallel    FSDP2 with dist.tensor_parallel=2: samples counted once per tensor-parallel group
Then what FSDP2 adds on GPUs, each row with the figure it records and the line it must pass (after the
one-GPU set: with --budget 480 they are rows "not run", said so; the whole set needs about 20 minutes):
  lora_sft_gpu       experiment=lora_sft_gpu on every GPU here, on the demo base: bf16, activation
                     checkpointing, the chat sample generated over NCCL. Records samples/s and peak memory;
                     passes when fit completes, a sample is generated and checkpoints hold the adapters only
  cpu_offload        FSDP2 with and without dist.fsdp.cpu_offload=true (a 57M-parameter Transformer).
                     Records both runs' peak GPU memory and where parameters and optimizer states live;
                     passes when both fit and test, the offloaded one keeps them in host memory, peaks
                     lower, and resumes from its checkpoint
  compile_fsdp2      FSDP2 with activation checkpointing, eager and compile=true (inductor, each block).
                     Records both runs' median step; passes when both fit and test, the compiled one says
                     each block was compiled, and its step takes at most 1.5 times the eager one's
  uneven_split       FSDP2 on 2 GPUs, validation and test splits of 17 and 41 samples in batches of 4
                     (shares one batch apart when batched plainly). Records every val/test metric against
                     one GPU's; passes when both complete and each metric agrees within 1e-4
  side_groups        FSDP2 on 2 GPUs with asynchronous saves, SIGUSR1 to rank 0 at step 5: the ranks agree
                     over the gloo side group, save and stop together. Records the step and the shards;
                     passes when the run stops saying so, requeue.ckpt holds 2 shards and resumes
  sync_batchnorm     FSDP2 on 2 GPUs with trainer.sync_batchnorm=true on the ResNet-18 (BatchNorm).
                     Records the largest difference between the ranks' running means; passes at <= 1e-5
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PASSED, FAILED, NOT_RUN, TIMED_OUT, RUNNING = "passed", "failed", "not run", "timed out", "running"
ALL_RAN, FAILURE, BAD_ARGUMENT, PARTIAL = 0, 1, 2, 3  # the exit statuses (see the docstring)
RESULTS = "gpu_checks.json"
TABLE = "gpu_checks.txt"
REPORT = "{date}-gpu-checks.md"
BUDGET_S = 900.0  # the whole tool's deadline by default
LEAST_S = 20.0  # a check is not started with less of the budget left than this
MFU_FLOOR = 0.15  # a compute-bound Transformer in bf16 below this share of the peak: something is wrong
SYNCS_PER_STEP = 1.0  # the host may wait for the GPU about once per training step (the logged loss)
RESULT = "result.json"  # what a check's process leaves in its folder
# A check's training runs: seconds each, not an epoch
TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=20",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=5",
]
# The trainer presets the checks train with (a rehearsal of the checks' own code on CPU swaps in
# ddp_cpu and fsdp_cpu: what it shows is the plumbing, never the GPU)
TRAINER = {"gpu": "trainer=gpu", "ddp": "trainer=ddp", "fsdp": "trainer=fsdp"}
# Launchers' variables of the shell the tool runs in (an srun step, torchrun): not the checks' runs'
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_VARS += ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")


@dataclass
class Result:
    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int  # the GPUs it needs (0: runs anywhere)
    timeout_s: float
    run: Callable[[Path, int], Result] | None = None  # in the check's own process: (its folder, GPUs here)

    def command(self, folder: Path, gpus: int) -> list[str]:
        """The check's own process: this script, running just this check."""
        script = str(Path(__file__).resolve())
        return [sys.executable, script, "--run", self.name, "--out", str(folder), "--gpus", str(gpus)]


# ---------------------------------------------------------------------------------------------- helpers


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without the launcher's variables of the shell the tool was started in (an srun
    step's SLURM_* would make each training run one task of it); node-local scratch stays."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("SLURM_", "SRUN_", "TORCHELASTIC_")) or k in LAUNCH_VARS) or k == "SLURM_TMPDIR"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), env.get("PYTHONPATH")]))
    return {**env, **(extra or {})}


@dataclass
class Run:
    """One `python src/train.py` of a check: its exit status, run dir and output."""

    returncode: int
    run_dir: Path
    output: str

    def last_error(self) -> str:
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:") or "Error" in line.split(":")[0]]
        return (errors or lines or ["no output"])[-1][:300]

    def outcome(self) -> dict[str, Any]:
        import yaml

        path = self.run_dir / "outcome.yaml"
        return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def train(folder: Path, name: str, *overrides: str, env: dict[str, str] | None = None) -> Run:
    """`python src/train.py` into <folder>/<name>, its output in <folder>/<name>.log (and in this check's)."""
    run_dir = folder / name
    log = folder / f"{name}.log"
    command = [sys.executable, "src/train.py", *overrides, f"hydra.run.dir={run_dir}"]
    print(f"$ {' '.join(command)}", flush=True)
    with open(log, "w") as out:
        result = subprocess.run(
            command, cwd=ROOT, env=env or clean_env(), stdout=out, stderr=subprocess.STDOUT
        )
    output = log.read_text(errors="replace")
    print(output[-4000:], flush=True)
    return Run(result.returncode, run_dir, output)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_task_env(rank: int, tasks: int, port: int, share_one_gpu: bool = False) -> dict[str, str]:
    """What Slurm gives task `rank` of an `srun --ntasks-per-node=<tasks> --gpus-per-task=1` step on one
    node: its own GPU only (CUDA_VISIBLE_DEVICES), so every task's GPU is its device 0. `share_one_gpu`:
    of `--gres=gpu:1 --ntasks-per-node=<tasks>` instead, every task the same GPU."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    job = os.environ.get("SLURM_JOB_ID", "999999999")  # the job the tool runs in: scontrol knows it
    counts = {"SLURM_NTASKS": tasks, "SLURM_NPROCS": tasks, "SLURM_NTASKS_PER_NODE": tasks}
    counts |= {"SLURM_TASKS_PER_NODE": tasks, "SLURM_STEP_NUM_TASKS": tasks}
    own = (
        (visible[0] if visible else "0")
        if share_one_gpu
        else (visible[rank] if rank < len(visible) else str(rank))
    )
    gpus = {"SLURM_GPUS_ON_NODE": "1"} if share_one_gpu else {"SLURM_GPUS_PER_TASK": "1"}
    return {
        **{k: str(v) for k, v in counts.items()},
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NAME": "gpu_checks",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODELIST": socket.gethostname(),
        "SLURM_JOB_NODELIST": socket.gethostname(),
        **gpus,
        "CUDA_VISIBLE_DEVICES": own,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_tasks(folder: Path, name: str, commands: list[list[str]], envs: list[dict[str, str]]) -> list[int]:
    """Start one process per task at once, as srun does; their exit statuses."""
    logs = [folder / f"{name}.rank{rank}.log" for rank in range(len(commands))]
    with contextlib.ExitStack() as files:
        procs = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=files.enter_context(open(log, "w")),
                stderr=subprocess.STDOUT,
            )
            for command, env, log in zip(commands, envs, logs, strict=True)
        ]
        codes = [proc.wait() for proc in procs]
    for rank, log in enumerate(logs):
        print(f"--- {name} rank {rank}\n{log.read_text(errors='replace')[-3000:]}", flush=True)
    return codes


def experiment_with_plan() -> str | None:
    """The shipped experiment whose model has a tensor-parallel plan (the character Transformer), if this
    project has it (a project made without the examples does not)."""
    return "char_transformer" if (ROOT / "conf" / "experiment" / "char_transformer.yaml").is_file() else None


# ----------------------------------------------------------------------------------------------- checks


def environment(folder: Path, gpus: int) -> Result:
    import platform

    import torch

    from hpctrain import __version__
    from hpctrain.runtime.environment import allocated, cuda

    count = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    capabilities = [".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(count)]
    driver = cuda.driver_version()
    details = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "hpctrain": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_architectures": torch.cuda.get_arch_list() if torch.version.cuda else [],
        "driver": driver,
        "gpus": count,
        "gpu_devices": allocated.gpus_on_node(),
        "gpu_names": names,
        "compute_capabilities": capabilities,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpus": len(os.sched_getaffinity(0)),
    }
    shown = f"{count} x {names[0]}" if count else "no GPU"
    summary = (
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), driver {driver or 'none'}, "
        f"{shown}, {details['cpus']} CPUs"
    )
    return Result(PASSED, summary, details)


def cuda_driver(folder: Path, gpus: int) -> Result:
    import torch

    from hpctrain.runtime.environment import cuda
    from hpctrain.runtime.errors import UserError

    build = cuda.torch_build() or (torch.__version__, torch.version.cuda)
    driver = cuda.driver_version()
    try:
        cuda.check_cuda_build(gpus, build, driver, cuda_starts=torch.cuda.is_available)
    except UserError as err:
        return Result(FAILED, str(err), {"torch": build[0], "torch_cuda": build[1], "driver": driver})
    if not torch.cuda.is_available():
        return Result(
            FAILED, f"CUDA does not start with driver {driver} (torch {build[0]})", {"driver": driver}
        )
    architectures = torch.cuda.get_arch_list()
    ran, failed = [], []
    for i in range(torch.cuda.device_count()):
        name, (major, minor) = torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)
        try:
            x = torch.randn(512, 512, device=f"cuda:{i}")
            float((x @ x).sum())
            ran.append(f"{name} (sm_{major}{minor})")
        except RuntimeError as err:  # "no kernel image is available": an architecture the build dropped
            failed.append(
                f"{name} (sm_{major}{minor}) cannot run torch {build[0]}, built for {', '.join(architectures)} "
                f"({' '.join(str(err).split())[:120]}); install a build for it: make install CUDA=cu126"
            )
    details = {"torch": build[0], "torch_cuda": build[1], "driver": driver, "architectures": architectures}
    if failed:
        return Result(FAILED, failed[0], {**details, "failed": failed})
    needed = cuda.driver_needed(build[1] or "") or "?"
    return Result(
        PASSED,
        f"CUDA {build[1]} on driver {driver} (needs >= {needed}): a matmul on {', '.join(ran)}",
        details,
    )


def bf16(folder: Path, gpus: int) -> Result:
    import torch

    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return Result(PASSED, f"native bfloat16 on {name} (sm_{major}{minor})", {"native": True})
    run = train(
        folder, "bf16_mixed", "experiment=quickstart", TRAINER["gpu"], "trainer.precision=bf16-mixed", *TINY
    )
    said = "emulat" in run.output.lower()
    details = {"native": False, "exit_status": run.returncode, "said_emulated": said}
    if run.returncode != 0:
        return Result(FAILED, f"bf16-mixed failed on {name}: {run.last_error()}", details)
    if not said:
        return Result(
            FAILED, f"bf16-mixed ran emulated on {name} (sm_{major}{minor}) without saying so", details
        )
    return Result(
        PASSED, f"bfloat16 is emulated on {name}: the run says so (use trainer.precision=16-mixed)", details
    )


def precisions(folder: Path, gpus: int) -> Result:
    ran = {}
    for precision in ("32-true", "16-mixed", "bf16-mixed", "bf16-true"):
        run = train(
            folder,
            precision,
            "experiment=quickstart",
            TRAINER["gpu"],
            f"trainer.precision={precision}",
            *TINY,
        )
        ran[precision] = "ok" if run.returncode == 0 else run.last_error()
    failed = [p for p, what in ran.items() if what != "ok"]
    if failed:
        return Result(FAILED, f"{', '.join(failed)} failed: {ran[failed[0]]}", ran)
    return Result(PASSED, f"fit and test in {', '.join(ran)}", ran)


def sync_points(folder: Path, gpus: int) -> Result:
    places = folder / "places.json"
    steps = 10  # SyncWindow's window: training steps 5 to 14
    run = train(
        folder,
        "sync",
        "experiment=quickstart",
        TRAINER["gpu"],
        *TINY,
        "+callbacks.sync_window._target_=gpu_checks.SyncWindow",
        f"+callbacks.sync_window.out={places}",
    )
    if run.returncode != 0 or not places.is_file():
        return Result(FAILED, f"the run failed: {run.last_error()}")
    found = json.loads(places.read_text())
    per_step = sum(found.values()) / steps  # the first validation's are counted too: an upper bound
    details = {"places": found, "per_step": per_step, "most_allowed_per_step": SYNCS_PER_STEP}
    where = f", most at {max(found, key=found.get)} ({max(found.values())})" if found else ""
    summary = f"{per_step:.1f} host waits for the GPU per training step (10 steps and a validation){where}"
    if per_step > SYNCS_PER_STEP:
        return Result(FAILED, f"{summary}: more than {SYNCS_PER_STEP:g} per step stalls the GPU", details)
    return Result(PASSED, summary, details)


# A Transformer large enough that its matrix products, not the host or the launches, set the pace
COMPUTE_BOUND = [
    "experiment=char_transformer",
    "model.net.n_layer=8",
    "model.net.n_head=16",
    "model.net.n_embd=1024",
    "model.net.dropout=0.0",
    "data.block_size=512",
    "data.batch_size=16",
    "callbacks.text_sample=null",
    "trainer.precision=bf16-mixed",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=60",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=20",
    "test=false",
    "callbacks.performance.gpu_every_s=1",
]


def mfu(folder: Path, gpus: int) -> Result:
    import csv

    import torch

    name = torch.cuda.get_device_name(0)
    if experiment_with_plan() is None:
        return Result(NOT_RUN, "no Transformer here to measure (conf/experiment/char_transformer.yaml)")
    run = train(folder, "mfu", *COMPUTE_BOUND, TRAINER["gpu"])
    if run.returncode != 0:
        return Result(FAILED, f"the run failed: {run.last_error()}")
    performance = run.outcome().get("performance") or {}
    columns: set[str] = set()
    with contextlib.suppress(OSError, StopIteration), open(run.run_dir / "metrics.csv", newline="") as file:
        columns = set(next(csv.reader(file)))
    details = {
        "gpu": name,
        "tflops_per_device": performance.get("tflops_per_device"),
        "mfu": performance.get("mfu"),
        "floor": MFU_FLOOR,
        "nvml_columns": sorted(c for c in columns if c.startswith("gpus/")),
    }
    share = performance.get("mfu")
    if not share:
        return Result(
            FAILED,
            f"no MFU for {name}: its peak FLOP/s is in neither hpctrain's table nor Lightning's "
            "(callbacks.performance.peak_flops=<FLOP/s> sets one)",
            details,
        )
    said = f"{performance['tflops_per_device']:.3g} TFLOP/s, MFU {100 * share:.1f}% on {name}"
    if share < MFU_FLOOR:
        return Result(
            FAILED,
            f"{said}: below {100 * MFU_FLOOR:.0f}% on a compute-bound Transformer in bf16 (a throttled GPU, "
            "the wrong peak, or the host in the way: see sync_points)",
            details,
        )
    if not details["nvml_columns"]:
        return Result(FAILED, f"{said}, but no NVML columns in metrics.csv", details)
    return Result(PASSED, f"{said}; {len(details['nvml_columns'])} NVML columns", details)


def one_gpu_per_task(folder: Path, gpus: int) -> Result:
    tasks = 2
    port = free_port()
    envs = [clean_env(slurm_task_env(rank, tasks, port)) for rank in range(tasks)]
    overrides = ["experiment=quickstart", TRAINER["ddp"], f"trainer.devices={tasks}", "requeue.enabled=false"]
    command = [sys.executable, "src/train.py", *overrides, *TINY, f"hydra.run.dir={folder / 'train'}"]
    trained = run_tasks(folder, "train", [command] * tasks, envs)
    port = free_port()
    envs = [clean_env(slurm_task_env(rank, tasks, port)) for rank in range(tasks)]
    # the GPU a task sees and the group over nccl (the data dir is the check's own: the node's data is not asked)
    doctor = [
        sys.executable,
        "scripts/doctor.py",
        f"paths.log_dir={folder / 'doctor'}",
        f"paths.data_dir={folder}",
    ]
    doctored = run_tasks(folder, "doctor", [doctor] * tasks, envs)
    details = {"train_exit_statuses": trained, "doctor_exit_statuses": doctored}
    if any(trained):
        return Result(FAILED, f"training with one GPU per task failed (exit statuses {trained})", details)
    if any(doctored):
        return Result(
            FAILED, f"scripts/doctor.py with one GPU per task failed (exit statuses {doctored})", details
        )
    return Result(PASSED, "2 tasks of one GPU each: training and scripts/doctor.py", details)


def ddp_nccl(folder: Path, gpus: int) -> Result:
    run = train(folder, "ddp", "experiment=quickstart", TRAINER["ddp"], f"trainer.devices={gpus}", *TINY)
    if run.returncode != 0:
        return Result(FAILED, f"DDP on {gpus} GPU(s) failed: {run.last_error()}")
    return Result(PASSED, f"DDP over nccl on {gpus} GPU(s): fit and test")


def flight_recorder(folder: Path, gpus: int) -> Result:
    """In this process: a process group of one over nccl, a few all-reduces, hpctrain's dump of the flight
    record (what every rank writes as the watchdog ends a hang), read back by torch's reader."""
    import pickle

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # read as the group is made
            "TORCH_FR_DUMP_TEMP_FILE": str(folder / "flight_recorder" / "rank"),
        }
    )
    (folder / "flight_recorder").mkdir(exist_ok=True)
    import torch
    import torch.distributed as dist

    from hpctrain.runtime.distributed import flight_recorder as recorder

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        x = torch.ones(1 << 20, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        written = recorder.dump()
    finally:
        dist.destroy_process_group()
    if written is None:
        return Result(
            FAILED, "hpctrain's dump wrote no flight record (TORCH_NCCL_TRACE_BUFFER_SIZE=2000 was set)"
        )
    entries = pickle.loads(written.read_bytes()).get("entries") or []
    reduces = [e for e in entries if "all_reduce" in str(e.get("profiling_name"))]
    reader = [
        sys.executable,
        "-m",
        "torch.distributed.flight_recorder.fr_trace",
        str(written.parent),
        "--prefix",
        "rank",
    ]
    read = subprocess.run(reader, cwd=ROOT, capture_output=True, text=True, timeout=120)
    details = {
        "file": str(written),
        "entries": len(entries),
        "all_reduces": len(reduces),
        "fr_trace_exit_status": read.returncode,
    }
    if len(reduces) < 3:
        return Result(FAILED, f"the flight record holds {len(reduces)} of the 3 all-reduces", details)
    if read.returncode != 0:
        last = (read.stderr or read.stdout).strip().splitlines()[-1:] or ["no output"]
        return Result(FAILED, f"torch's reader cannot read hpctrain's dump: {last[0][:200]}", details)
    return Result(
        PASSED,
        f"the flight record of {len(entries)} collectives, dumped by hpctrain and read by torch's reader",
        details,
    )


def async_dcp(folder: Path, gpus: int) -> Result:
    common = [
        "experiment=quickstart",
        TRAINER["fsdp"],
        "trainer.devices=1",
        *TINY,
        "checkpoints.async_save=true",
    ]
    first = train(folder, "async", *common)
    last = first.run_dir / "checkpoints" / "last.ckpt"
    details = {"exit_status": first.returncode}
    if first.returncode != 0:
        return Result(FAILED, f"FSDP2 with an asynchronous save failed: {first.last_error()}", details)
    shards = sorted(p.name for p in last.glob("*.distcp")) if last.is_dir() else []
    details["shards"] = shards
    if not shards or not (last / ".metadata").is_file():
        return Result(FAILED, f"no complete sharded checkpoint in {last}", details)
    again = [o.replace("trainer.max_epochs=1", "trainer.max_epochs=2") for o in common]
    resumed = train(folder, "resumed", *again, f"ckpt_path={last}")
    details["resumed_exit_status"] = resumed.returncode
    if resumed.returncode != 0:
        return Result(
            FAILED, f"the resume from the asynchronous save failed: {resumed.last_error()}", details
        )
    return Result(
        PASSED, f"an asynchronous sharded save ({len(shards)} shard(s)) committed, read and resumed", details
    )


def two_tasks_one_gpu(folder: Path, gpus: int) -> Result:
    tasks = 2
    port = free_port()
    envs = [clean_env(slurm_task_env(rank, tasks, port, share_one_gpu=True)) for rank in range(tasks)]
    overrides = [
        "experiment=quickstart",
        TRAINER["ddp"],
        f"trainer.devices={tasks}",
        "dist.backend=gloo",
        "requeue.enabled=false",
    ]
    command = [sys.executable, "src/train.py", *overrides, *TINY, f"hydra.run.dir={folder / 'train'}"]
    codes = run_tasks(folder, "train", [command] * tasks, envs)
    if any(codes):
        return Result(
            FAILED,
            f"2 tasks sharing one GPU over gloo failed (exit statuses {codes})",
            {"exit_statuses": codes},
        )
    return Result(
        PASSED,
        "2 tasks as Slurm starts them, sharing one GPU over gloo: fit and test",
        {"exit_statuses": codes},
    )


def watchdog(folder: Path, gpus: int) -> Result:
    tasks = 2
    port = free_port()
    envs = [
        clean_env({**slurm_task_env(rank, tasks, port, share_one_gpu=True), "TORCH_FR_BUFFER_SIZE": "2000"})
        for rank in range(tasks)
    ]
    stalled = [
        "experiment=quickstart",
        TRAINER["ddp"],
        f"trainer.devices={tasks}",
        "dist.backend=gloo",
        "requeue.enabled=false",
        *TINY,
        "dist.timeout_min=0.25",
        "+callbacks.stall._target_=gpu_checks.StallRank",
        "+callbacks.stall.rank=1",
        "+callbacks.stall.at_step=3",
        "+callbacks.stall.seconds=600",
        f"hydra.run.dir={folder / 'hang'}",
    ]
    codes = run_tasks(folder, "hang", [[sys.executable, "src/train.py", *stalled]] * tasks, envs)
    output = "".join((folder / f"hang.rank{r}.log").read_text(errors="replace") for r in range(tasks))
    named = "rank 1 on" in output and "did not arrive" in output
    records = sorted(p.name for p in (folder / "hang" / "flight_recorder").glob("rank*"))
    details = {"exit_statuses": codes, "rank_1_named": named, "flight_records": records}
    if not any(codes):
        return Result(FAILED, "the run with rank 1 stuck completed: the stall did not take", details)
    if not named:
        return Result(FAILED, "the watchdog did not name the stuck rank 1", details)
    import torch._C._distributed_c10d as c10d

    if hasattr(c10d, "_dump_fr_trace") and records != ["rank0", "rank1"]:
        return Result(FAILED, f"rank 1 named, but the flight records are {records or 'missing'}", details)
    return Result(
        PASSED, f"rank 1, stuck, named before the collective timeout; flight records {records}", details
    )


def nccl_hang_named(folder: Path, gpus: int) -> Result:
    env = clean_env(
        {  # as slurm/train.sbatch and slurm/site.sh set them
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        }
    )
    run = train(
        folder,
        "hang",
        "experiment=quickstart",
        TRAINER["ddp"],
        "trainer.devices=2",
        *TINY,
        "dist.timeout_min=0.25",
        "+callbacks.stall._target_=gpu_checks.StallRank",
        "+callbacks.stall.rank=1",
        "+callbacks.stall.at_step=3",
        "+callbacks.stall.seconds=600",
        env=env,
    )
    dumps = sorted(p.name for p in (run.run_dir / "flight_recorder").glob("rank*"))
    recorder = str(run.run_dir / "flight_recorder")
    reader = [
        sys.executable,
        "-m",
        "torch.distributed.flight_recorder.fr_trace",
        recorder,
        "--prefix",
        "rank",
    ]
    read = subprocess.run(reader, cwd=ROOT, capture_output=True, text=True, timeout=120)
    named = "rank 1 on" in run.output
    details = {
        "exit_status": run.returncode,
        "rank_1_named": named,
        "flight_recorder_dumps": dumps,
        "fr_trace_exit_status": read.returncode,
        "sentence": run.last_error(),
    }
    if run.returncode == 0:
        return Result(FAILED, "the run with rank 1 stuck completed: the stall did not take", details)
    if not named:
        return Result(FAILED, f"the stuck rank 1 is not named: {run.last_error()}", details)
    if not dumps or read.returncode != 0:
        return Result(
            FAILED, f"rank 1 named, but the flight recorder left {len(dumps)} dump(s) torch reads", details
        )
    return Result(PASSED, f"rank 1 named; {len(dumps)} flight recorder dumps read", details)


def tensor_parallel(folder: Path, gpus: int) -> Result:
    experiment = experiment_with_plan()
    if experiment is None:
        return Result(
            NOT_RUN, "no model with a tensor-parallel plan here (conf/experiment/char_transformer.yaml)"
        )
    run = train(
        folder,
        "tp",
        f"experiment={experiment}",
        TRAINER["fsdp"],
        "trainer.devices=2",
        "dist.tensor_parallel=2",
        *TINY,
    )
    if run.returncode != 0:
        return Result(FAILED, f"FSDP2 with dist.tensor_parallel=2 failed: {run.last_error()}")
    performance = run.outcome().get("performance") or {}
    ranks = [r.get("samples_per_s") for r in (performance.get("ranks") or {}).values()]
    job = performance.get("samples_per_s")
    if not job or not ranks or not all(ranks):
        return Result(FAILED, "no samples/s per rank in outcome.yaml", performance)
    ratio = job / (sum(ranks) / len(ranks))  # one tensor-parallel group of 2: the job's is one rank's
    details = {"samples_per_s": job, "ranks_samples_per_s": ranks, "ratio": round(ratio, 3)}
    if not 0.75 <= ratio <= 1.25:
        return Result(
            FAILED, f"samples/s counted {ratio:.2f} times over a tensor-parallel group of 2", details
        )
    return Result(PASSED, "FSDP2 x tensor parallel on 2 GPUs: samples counted once per group", details)


def fsdp2(folder: Path, gpus: int) -> Result:
    experiment = experiment_with_plan() or "quickstart"  # the character Transformer, its text sample on
    common = [f"experiment={experiment}", TRAINER["fsdp"], *TINY, "dist.timeout_min=5"]
    first = train(folder, "fsdp", *common, f"trainer.devices={gpus}")
    if first.returncode != 0:
        return Result(
            FAILED, f"FSDP2 on {gpus} GPUs failed: {first.last_error()}", {"experiment": experiment}
        )
    last = first.run_dir / "checkpoints" / "last.ckpt"
    shards = sorted(p.name for p in last.glob("*.distcp")) if last.is_dir() else []
    details = {"experiment": experiment, "gpus": gpus, "shards": len(shards)}
    if not shards:
        return Result(FAILED, f"no sharded checkpoint in {last}", details)
    fewer = max(1, gpus // 2)
    again = [o.replace("trainer.max_epochs=1", "trainer.max_epochs=2") for o in common]  # one epoch more
    resumed = train(folder, "resumed", *again, f"trainer.devices={fewer}", f"ckpt_path={last}")
    details["resumed_on"] = fewer
    if resumed.returncode != 0:
        return Result(FAILED, f"the resume on {fewer} GPU(s) failed: {resumed.last_error()}", details)
    return Result(
        PASSED,
        f"{experiment} in bf16 on {gpus} GPUs, fit and test; {len(shards)} shards resumed on {fewer}",
        details,
    )


def lora_sft_gpu(folder: Path, gpus: int) -> Result:
    import importlib.util

    if not (ROOT / "conf" / "experiment" / "lora_sft_gpu.yaml").is_file():
        return Result(NOT_RUN, "no experiment=lora_sft_gpu here (conf/experiment/lora_sft_gpu.yaml)")
    missing = [
        m for m in ("transformers", "peft", "tokenizers", "safetensors") if not importlib.util.find_spec(m)
    ]
    if missing:
        return Result(NOT_RUN, f"the llm extra is missing ({', '.join(missing)}): pip install -e '.[llm]'")
    demo = folder / "tiny_llm"  # made offline by the datamodule (data.demo=true), as experiment=lora_sft does
    run = train(
        folder,
        "lora",
        "experiment=lora_sft_gpu",
        f"model.base.path={demo / 'base'}",
        f"data.path={demo / 'sft.jsonl'}",
        "data.demo=true",
        "data.max_length=64",
        f"trainer.devices={gpus}",
        *TINY,
        "callbacks.chat_sample.max_new_tokens=8",
    )
    performance = run.outcome().get("performance") or {}
    details = {
        "gpus": gpus,
        "samples_per_s": performance.get("samples_per_s"),
        "peak_mem_mib": performance.get("peak_mem_mib"),
        "sampled": "sample after epoch 0:" in run.output,
        "adapters_only": "checkpoints: the trainable parameters only" in run.output,
    }
    if run.returncode != 0:
        return Result(FAILED, f"experiment=lora_sft_gpu failed: {run.last_error()}", details)
    if not details["sampled"]:
        return Result(FAILED, "no chat sample after validation (generate under FSDP2 over NCCL)", details)
    if not details["adapters_only"]:
        return Result(FAILED, "the checkpoints hold more than the adapters", details)
    return Result(
        PASSED,
        f"lora_sft_gpu on {gpus} GPU(s) in bf16 with activation checkpointing: {details['samples_per_s']} "
        f"samples/s, peak {details['peak_mem_mib']} MiB; a sample generated, adapters-only checkpoints",
        details,
    )


# A Transformer whose parameters, gradients and Adam states (about 0.9 GB) outweigh its activations
SIZEABLE = [
    "model.net.n_layer=8",
    "model.net.n_head=12",
    "model.net.n_embd=768",
    "model.net.dropout=0.0",
    "data.block_size=256",
    "data.batch_size=8",
    "callbacks.text_sample=null",
    TRAINER["fsdp"],
    *TINY,
]


def cpu_offload(folder: Path, gpus: int) -> Result:
    experiment = experiment_with_plan()
    if experiment is None:
        return Result(NOT_RUN, "no Transformer here (conf/experiment/char_transformer.yaml)")
    common = [f"experiment={experiment}", *SIZEABLE, f"trainer.devices={gpus}"]
    plain = train(folder, "plain", *common)
    placed = folder / "placed.json"
    offload = [*common, "dist.fsdp.cpu_offload=true", "+callbacks.placed._target_=gpu_checks.WherePlaced"]
    offloaded = train(folder, "offloaded", *offload, f"+callbacks.placed.out={placed}")
    peaks = [(r.outcome().get("performance") or {}).get("peak_mem_mib") for r in (plain, offloaded)]
    where = json.loads(placed.read_text()) if placed.is_file() else {}
    details = {"peak_mem_mib": peaks, "placed": where}
    for name, run in (("without", plain), ("with", offloaded)):
        if run.returncode != 0:
            return Result(FAILED, f"FSDP2 {name} cpu_offload failed: {run.last_error()}", details)
    if where != {"parameters": ["cpu"], "optimizer_states": ["cpu"]}:
        return Result(FAILED, f"under cpu_offload, parameters and optimizer states live on {where}", details)
    if not all(peaks) or peaks[1] >= peaks[0]:
        return Result(FAILED, f"peak GPU memory {peaks[1]} MiB with cpu_offload, {peaks[0]} without", details)
    last = offloaded.run_dir / "checkpoints" / "last.ckpt"
    again = [o.replace("trainer.max_epochs=1", "trainer.max_epochs=2") for o in offload]
    resumed = train(folder, "resumed", *again, f"+callbacks.placed.out={placed}", f"ckpt_path={last}")
    if resumed.returncode != 0:
        return Result(FAILED, f"the resume under cpu_offload failed: {resumed.last_error()}", details)
    return Result(
        PASSED,
        f"cpu_offload: parameters and optimizer states in host memory, peak {peaks[1]} MiB against {peaks[0]} "
        "without; fit, test and a resume",
        details,
    )


def compile_fsdp2(folder: Path, gpus: int) -> Result:
    experiment = experiment_with_plan()
    if experiment is None:
        return Result(NOT_RUN, "no Transformer here (conf/experiment/char_transformer.yaml)")
    common = [f"experiment={experiment}", *SIZEABLE, f"trainer.devices={gpus}"]
    common += ["dist.fsdp.activation_checkpointing=true", "trainer.limit_train_batches=60"]
    eager, compiled = train(folder, "eager", *common), train(folder, "compiled", *common, "compile=true")
    steps = [(r.outcome().get("performance") or {}).get("step_ms") for r in (eager, compiled)]
    details = {"step_ms": steps, "said": "each block compiled (inductor)" in compiled.output}
    for name, run in (("eager", eager), ("compiled", compiled)):
        if run.returncode != 0:
            return Result(FAILED, f"FSDP2 {name} failed: {run.last_error()}", details)
    if not details["said"]:
        return Result(FAILED, "compile=true under FSDP2 did not compile each block", details)
    if not all(steps) or steps[1] > 1.5 * steps[0]:
        return Result(FAILED, f"a compiled step takes {steps[1]} ms, an eager one {steps[0]} ms", details)
    return Result(PASSED, f"each block compiled: {steps[1]} ms a step against {steps[0]} ms eager", details)


def uneven_split(folder: Path, gpus: int) -> Result:
    import csv

    common = [
        "experiment=quickstart",
        "data.val_fraction=0.00946",  # 17 samples: shares of 9 and 8 on 2 ranks, 3 batches and 2 plainly
        "data.test_fraction=0.0228",  # 41: 21 and 20
        "data.batch_size=4",
        "trainer.num_sanity_val_steps=-1",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "model.optimizer.lr=1e-30",  # a step that changes nothing: the evaluation of the same weights
        "trainer.precision=32-true",
        "extras.float32_matmul_precision=highest",
        "dist.timeout_min=1",
        "dist.init_timeout_min=5",
    ]
    runs = [train(folder, "one", *common, TRAINER["gpu"])]
    runs.append(train(folder, "two", *common, TRAINER["fsdp"], "trainer.devices=2"))
    metrics = []
    for run in runs:
        if run.returncode != 0:
            return Result(FAILED, f"a run failed (or hung): {run.last_error()}")
        with open(run.run_dir / "metrics.csv", newline="") as file:
            rows = list(csv.DictReader(file))
        metrics.append(
            {k: float(v) for r in rows for k, v in r.items() if k.startswith(("val/", "test/")) and v}
        )
    one, two = metrics
    apart = {k: abs(two.get(k, float("nan")) - v) for k, v in one.items()}
    details = {"one_gpu": one, "two_gpus": two, "differences": apart}
    if not one or not all(d <= 1e-4 for d in apart.values()):
        return Result(FAILED, f"the metrics of 2 GPUs differ from one GPU's: {apart}", details)
    return Result(PASSED, f"{len(one)} val/test metrics of 2 GPUs within 1e-4 of one GPU's, no hang", details)


def side_groups(folder: Path, gpus: int) -> Result:
    common = ["experiment=quickstart", TRAINER["fsdp"], "trainer.devices=2", "checkpoints.async_save=true"]
    common += [
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=20",
        "trainer.limit_val_batches=2",
        "test=false",
    ]
    signal_at = ["+callbacks.signal._target_=gpu_checks.SignalAt", "+callbacks.signal.step=5"]
    stopped = train(folder, "stopped", *common, *signal_at)
    saved = stopped.run_dir / "checkpoints" / "requeue.ckpt"
    shards = sorted(p.name for p in saved.glob("*.distcp")) if saved.is_dir() else []
    said = "stopped on SIGUSR1 during training: saved" in stopped.output
    details = {"exit_status": stopped.returncode, "said": said, "shards": shards}
    if stopped.returncode != 128 + signal.SIGTERM or not said:
        return Result(
            FAILED, f"the signal did not stop both ranks with a save: {stopped.last_error()}", details
        )
    if len(shards) != 2:
        return Result(FAILED, f"requeue.ckpt holds {len(shards)} shard(s), not 2", details)
    resumed = train(folder, "resumed", *common, f"ckpt_path={saved}")
    if resumed.returncode != 0:
        return Result(FAILED, f"the resume from requeue.ckpt failed: {resumed.last_error()}", details)
    return Result(
        PASSED, "SIGUSR1 on rank 0: both ranks agreed, saved 2 shards and stopped; resumed", details
    )


def sync_batchnorm(folder: Path, gpus: int) -> Result:
    if not (ROOT / "conf" / "experiment" / "cifar10_resnet18.yaml").is_file():
        return Result(NOT_RUN, "no model with BatchNorm here (conf/experiment/cifar10_resnet18.yaml)")
    spread = folder / "spread.json"
    run = train(
        folder,
        "synced",
        "experiment=cifar10_resnet18",
        TRAINER["fsdp"],
        "trainer.devices=2",
        "trainer.sync_batchnorm=true",
        *TINY,
        "+callbacks.spread._target_=gpu_checks.BatchNormSpread",
        f"+callbacks.spread.out={spread}",
    )
    if run.returncode != 0 or not spread.is_file():
        return Result(FAILED, f"FSDP2 with trainer.sync_batchnorm=true failed: {run.last_error()}")
    largest = json.loads(spread.read_text())["largest"]
    details = {"largest_difference": largest}
    if not largest <= 1e-5:
        return Result(
            FAILED, f"the ranks' BatchNorm running means differ by {largest:.3g}: not synced", details
        )
    return Result(
        PASSED, f"BatchNorm synced under FSDP2: the ranks' running means within {largest:.2g}", details
    )


CHECKS = [  # the one-GPU set first (in under 8 minutes of --budget on one GPU), then the multi-GPU checks
    Check("environment", 0, 120, environment),
    Check("cuda_driver", 1, 120, cuda_driver),
    Check("bf16", 1, 180, bf16),
    Check("precisions", 1, 300, precisions),
    Check("sync_points", 1, 180, sync_points),
    Check("mfu", 1, 240, mfu),
    Check("ddp_nccl", 1, 180, ddp_nccl),
    Check("flight_recorder", 1, 120, flight_recorder),
    Check("fsdp2", 1, 600, fsdp2),
    Check("async_dcp", 1, 300, async_dcp),
    Check("two_tasks_one_gpu", 1, 240, two_tasks_one_gpu),
    Check("watchdog", 1, 240, watchdog),
    Check("lora_sft_gpu", 1, 300, lora_sft_gpu),
    Check("cpu_offload", 1, 420, cpu_offload),
    Check("compile_fsdp2", 1, 420, compile_fsdp2),
    Check("one_gpu_per_task", 2, 300, one_gpu_per_task),
    Check("nccl_hang_named", 2, 300, nccl_hang_named),
    Check("tensor_parallel", 2, 300, tensor_parallel),
    Check("uneven_split", 2, 300, uneven_split),
    Check("side_groups", 2, 300, side_groups),
    Check("sync_batchnorm", 2, 240, sync_batchnorm),
]


# ------------------------------------------------------------- the callbacks the checks add to their runs


def __getattr__(name: str) -> Any:
    """`gpu_checks.StallRank`, `gpu_checks.SyncWindow`, ...: callbacks a check adds to its training run
    (+callbacks.<key>._target_=gpu_checks.<Name>; scripts/ is on the run's PYTHONPATH), built on first use
    so that the tool itself imports neither torch nor Lightning."""
    if name in ("StallRank", "SyncWindow", "WherePlaced", "SignalAt", "BatchNormSpread"):
        return _callbacks()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _callbacks() -> dict[str, type]:
    import warnings

    from pytorch_lightning import Callback

    class StallRank(Callback):
        """Rank `rank` sleeps `seconds` in training step `at_step`, before its backward pass: the others
        wait for it in the backward pass's collective, as behind a rank stuck in its own code."""

        def __init__(self, rank: int = 1, at_step: int = 3, seconds: float = 600) -> None:
            self.rank, self.at_step, self.seconds = rank, at_step, seconds

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
                print(
                    f"gpu_checks: rank {self.rank} stalls for {self.seconds} s in step {self.at_step}",
                    flush=True,
                )
                time.sleep(self.seconds)

    class SyncWindow(Callback):
        """torch's synchronisation warnings in training steps `first` to `last` - 1 and in the first
        validation, counted by the line that made them, written to `out` (JSON) when training ends."""

        def __init__(self, out: str, first: int = 5, last: int = 15) -> None:
            self.out, self.first, self.last = out, first, last
            self._caught: list[Any] = []
            self._recording: Any = None
            self._validated = False

        def _mode(self, mode: str) -> None:
            import torch

            torch.cuda.set_sync_debug_mode(mode)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._recording = warnings.catch_warnings(record=True)
            self._caught = self._recording.__enter__()
            warnings.simplefilter("always")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._mode("warn" if self.first <= batch_idx < self.last else "default")

        def on_train_batch_end(self, *args: Any) -> None:
            self._mode("default")

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            if self._recording is not None and not self._validated:
                self._mode("warn")

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            self._validated = self._validated or self._recording is not None
            self._mode("default")

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._mode("default")
            if self._recording is not None:
                self._recording.__exit__(None, None, None)
                self._recording = None
            places: dict[str, int] = {}
            for caught in self._caught:
                if "synchroniz" in str(caught.message):
                    place = f"{Path(caught.filename).name}:{caught.lineno}"
                    places[place] = places.get(place, 0) + 1
            if trainer.is_global_zero:
                Path(self.out).write_text(json.dumps(places, indent=2))

    class WherePlaced(Callback):
        """As training ends, the devices the parameters' local shards and the optimizer states live on
        (rank 0 writes them to `out`, JSON): under cpu_offload, the host's."""

        def __init__(self, out: str) -> None:
            self.out = out

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            def local(t: Any) -> Any:
                return t.to_local() if callable(getattr(t, "to_local", None)) else t

            states = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()]
            found = {
                "parameters": sorted({local(p).device.type for p in pl_module.parameters()}),
                "optimizer_states": sorted({local(v).device.type for v in states if hasattr(v, "device")}),
            }
            if trainer.is_global_zero:
                Path(self.out).write_text(json.dumps(found))

    class SignalAt(Callback):
        """Rank 0 sends itself SIGUSR1 (the time limit's warning; outside Slurm: save and stop) at `step`."""

        def __init__(self, step: int = 5) -> None:
            self.step = step

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.is_global_zero and trainer.global_step == self.step:
                os.kill(os.getpid(), signal.SIGUSR1)

    class BatchNormSpread(Callback):
        """As training ends, the largest difference between the ranks' BatchNorm running means (rank 0
        writes it to `out`, JSON): 0 when their statistics are synchronised."""

        def __init__(self, out: str) -> None:
            self.out = out

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            import torch

            means = [
                m.running_mean for m in pl_module.modules() if getattr(m, "running_mean", None) is not None
            ]
            mine = torch.cat([m.float().flatten() for m in means]).to(trainer.strategy.root_device)
            every = trainer.strategy.all_gather(mine)
            largest = float((every.max(dim=0).values - every.min(dim=0).values).max())
            if trainer.is_global_zero:
                Path(self.out).write_text(json.dumps({"largest": largest}))

    return {
        "StallRank": StallRank,
        "SyncWindow": SyncWindow,
        "WherePlaced": WherePlaced,
        "SignalAt": SignalAt,
        "BatchNormSpread": BatchNormSpread,
    }


# ----------------------------------------------------------------------------------- running the checks


def write_results(out: Path, report: dict[str, Any]) -> None:
    """<out>/gpu_checks.json, replaced whole (a reader never sees half a file)."""
    partial = out / f".{RESULTS}.partial"
    partial.write_text(json.dumps(report, indent=2, default=str))
    os.replace(partial, out / RESULTS)


def end_group(proc: subprocess.Popen[bytes]) -> None:
    """End a check's process and everything it started: first SIGURG, on which each training run's ranks
    write their stacks to their run dir's stacks/ (diagnostics.stacks_signal; others ignore it), then
    SIGKILL."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGURG)
        time.sleep(1)  # faulthandler writes at once, from C
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def run_check(check: Check, out: Path, gpus: int, limit_s: float) -> dict[str, Any]:
    """Run one check in its own process group under `limit_s`; its row. Nothing raised escapes."""
    folder = out / check.name
    started = time.monotonic()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RESULT).unlink(missing_ok=True)
        with open(folder / "output.txt", "w") as log:
            proc = subprocess.Popen(
                check.command(folder, gpus),
                cwd=ROOT,
                env=clean_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout ends its training runs too
            )
            try:
                code = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                end_group(proc)
                stacks = sorted(str(p.parent) for p in folder.glob("**/stacks/rank*.txt"))
                where = f"; stacks in {', '.join(sorted(set(stacks)))}" if stacks else ""
                return row(check, TIMED_OUT, f"timed out after {limit_s:.0f} s{where}", started)
        if (folder / RESULT).is_file():
            result = json.loads((folder / RESULT).read_text())
            return row(check, result["status"], result["summary"], started, result.get("details"))
        lines = [
            line for line in (folder / "output.txt").read_text(errors="replace").splitlines() if line.strip()
        ]
        last = lines[-1].strip()[:300] if lines else "no output"
        return row(check, FAILED, f"its process ended with exit status {code}: {last}", started)
    except Exception as err:  # the tool itself must finish: a broken check is a failed row
        return row(check, FAILED, f"{type(err).__name__}: {err}", started)


def row(
    check: Check, status: str, summary: str, started: float | None, details: Any = None
) -> dict[str, Any]:
    seconds = round(time.monotonic() - started, 1) if started is not None else None
    return {
        "name": check.name,
        "status": status,
        "seconds": seconds,
        "summary": summary,
        "details": details or {},
    }


def gpus_here(environment_row: dict[str, Any] | None) -> tuple[int, int]:
    """The GPUs torch sees and the GPUs the node has (its device files), as the environment check found."""
    found = (environment_row or {}).get("details") or {}
    return int(found.get("gpus") or 0), int(found.get("gpu_devices") or 0)


def not_run_because(check: Check, environment_row: dict[str, Any] | None) -> str | None:
    """Why `check` cannot run here (None: it can), from what the environment check found."""
    if check.gpus == 0:
        return None
    if environment_row is None or environment_row["status"] != PASSED:
        return "the environment check did not pass"
    gpus, devices = gpus_here(environment_row)
    if gpus == 0 and devices > 0:  # the node has GPUs, but CUDA does not start: cuda_driver says why
        return None if check.name == "cuda_driver" else "CUDA does not start here (see cuda_driver)"
    if gpus == 0:
        return "no GPU here"
    if gpus < check.gpus:
        return f"needs {check.gpus} GPUs, {gpus} here"
    return None


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'check':18} {'result':10} {'time':>7}  what"]
    for r in rows:
        seconds = f"{r['seconds']:.0f} s" if r.get("seconds") is not None else "-"
        lines.append(f"{r['name']:18} {r['status']:10} {seconds:>7}  {r['summary']}")
    counts = {s: sum(r["status"] == s for r in rows) for s in (PASSED, NOT_RUN, FAILED, TIMED_OUT)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """The exit status and its line: a failure first, then whether every check ran."""
    failed = [r["name"] for r in rows if r["status"] in (FAILED, TIMED_OUT)]
    not_run = [f"{r['name']} ({r['summary']})" for r in rows if r["status"] == NOT_RUN]
    if failed:
        return FAILURE, f"failed: {', '.join(failed)}" + (
            f"; not run: {', '.join(not_run)}" if not_run else ""
        )
    if not_run:
        return PARTIAL, f"partial: every check that ran passed; could not run here: {'; '.join(not_run)}"
    return ALL_RAN, "all ran and passed"


def write_report(out: Path, report: dict[str, Any], shown: str, said: str) -> Path:
    """The dated report, to keep beside the benchmark reports: the node, its GPUs and software, the table."""
    found = next((r["details"] for r in report["checks"] if r["name"] == "environment"), None) or {}
    date = report["started"][:10]
    gpus = ", ".join(found.get("gpu_names") or []) or "no GPU"
    lines = [
        f"# GPU checks, {date}: {gpus}",
        "",
        f"`python scripts/{report['command']}` on {report['host']}, started {report['started']}.",
        "",
        f"- torch {found.get('torch')} (CUDA {found.get('torch_cuda') or 'none'}), driver {found.get('driver') or 'none'}, "
        f"hpctrain {found.get('hpctrain')}, Python {found.get('python')}",
        f"- GPUs: {gpus} (compute capability {', '.join(found.get('compute_capabilities') or []) or '-'}); "
        f"{found.get('cpus')} CPUs",
        f"- {said}",
        "",
        "```",
        shown,
        "```",
        "",
    ]
    path = out / REPORT.format(date=date)
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    names = [c.name for c in CHECKS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the output dir (default: logs/gpu_checks/<date>_<time>)")
    parser.add_argument(
        "--only", nargs="+", metavar="CHECK", help=f"run only these (environment always): {names}"
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds each check may take (default: each check's own)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help=f"seconds all the checks may take together (default {BUDGET_S:.0f}; 480 for the one-GPU set): "
        "a check that does not fit what is left is not run, and said so",
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # in a check's own process: run that check
    parser.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in CHECKS}
    if args.run in by_name and args.out:
        return run_in_this_process(by_name[args.run], Path(args.out), args.gpus)
    if args.list:
        print("\n".join(f"{c.name:18} {c.gpus} GPU(s), {c.timeout_s:.0f} s" for c in CHECKS))
        return ALL_RAN
    unknown = sorted(set(args.only or []) - set(names)) or sorted({args.run} - {None})
    if unknown:
        print(f"error: --only {unknown[0]} is not a check; choose from {', '.join(names)}.", file=sys.stderr)
        return BAD_ARGUMENT
    for flag, value in (("--timeout", args.timeout), ("--budget", args.budget)):
        if value is not None and not value > 0:
            print(f"error: {flag} {value:g} must be a number of seconds above 0.", file=sys.stderr)
            return BAD_ARGUMENT
    deadline = time.monotonic() + args.budget
    out = Path(args.out or ROOT / "logs" / "gpu_checks" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    out.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in CHECKS if c.name == "environment" or not args.only or c.name in args.only]
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": socket.gethostname(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "budget_s": args.budget,
        "finished": False,
        "checks": [],
    }
    rows: list[dict[str, Any]] = report["checks"]
    write_results(out, report)
    print(f"gpu checks: results in {out / RESULTS} after every check", flush=True)
    environment_row = None
    for check in chosen:
        why = not_run_because(check, environment_row)
        left = deadline - time.monotonic()
        if why is None and left < LEAST_S:
            why = f"the budget (--budget {args.budget:g} s) was spent before it"
        if why is not None:
            rows.append(row(check, NOT_RUN, why, None))
        else:
            rows.append(row(check, RUNNING, "running", None))
            write_results(out, report)  # a crash or a hang of the node leaves which check was running
            gpus = max(gpus_here(environment_row))
            own = args.timeout or check.timeout_s
            rows[-1] = run_check(check, out, gpus, min(own, left))
            if rows[-1]["status"] == TIMED_OUT and left < own:
                rows[-1]["summary"] += f" (all that was left of --budget {args.budget:g} s)"
        if check.name == "environment":
            environment_row = rows[-1]
        write_results(out, report)
        last = rows[-1]
        print(f"{last['name']:18} {last['status']:10} {last['summary']}", flush=True)
    code, said = verdict(rows)
    report["finished"], report["exit_status"], report["verdict"] = True, code, said
    write_results(out, report)
    shown = table(rows)
    (out / TABLE).write_text(shown + "\n")
    dated = write_report(out, report, shown, said)
    print(
        f"\n{shown}\n{said} (exit status {code})\n\nresults: {out / RESULTS}; the table: {out / TABLE}; the "
        f"report: {dated}; each check's output in {out}/<check>/"
    )
    return code


def run_in_this_process(check: Check, folder: Path, gpus: int) -> int:
    """A check's own process: run it, and leave its result in <folder>/result.json, whatever happens."""
    try:
        assert check.run is not None
        result = check.run(folder, gpus)
    except Exception as err:
        traceback.print_exc()
        result = Result(FAILED, f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")
    (folder / RESULT).write_text(json.dumps(result.__dict__, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
