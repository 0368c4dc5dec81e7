"""Starting the other local ranks of a DDP run from a Hydra job, for sweeps as well as single runs.

When no external launcher (srun, torchrun) started the processes, Lightning's DDP re-runs the script
for local ranks 1..N-1 with the parent's `sys.argv`. Under Hydra that is wrong twice: in a multirun
(`-m`) every child replays the whole sweep, and children write to `hydra.run.dir` instead of the
job's sweep subdir. `HydraDDPStrategy` starts them with exactly this job's overrides and output dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path

import __main__

# Hydra flags that are not overrides but choose the config; children need them too.
from hpctrain.runtime.config.compose import task_overrides

# Hydra flags that are not overrides but choose the config; children need them too.
from hpctrain.runtime.distributed import failures, watchdog
from hpctrain.runtime.environment import allocated, launched
from hpctrain.runtime.namespaces import LightningPart, Namespace

# Hydra flags that are not overrides but choose the config; children need them too.
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# Hydra overrides a child must not inherit: it runs one job in the parent job's dir.
_PARENT_ONLY = (
    "hydra.run",
    "hydra.sweep",
    "hydra.mode",
    "hydra.output_subdir",
    "hydra.job.num",
    "hydra.job.id",
    "hydra/launcher",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra.sweeper",
)
# Set in os.environ by Lightning's launcher; the next job of a sweep must start without them.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _config_flags(argv: list[str]) -> list[str]:
    flags = []
    for i, arg in enumerate(argv):
        if arg in _CONFIG_FLAGS and i + 1 < len(argv):
            flags += [arg, argv[i + 1]]
        elif arg.startswith(tuple(f"{flag}=" for flag in _CONFIG_FLAGS)):
            flags.append(arg)
    return flags


def child_command() -> tuple[list[str], str]:
    """The command line and cwd that rerun this Hydra job (and only it) in its output dir."""
    hydra_cfg = HydraConfig.get()
    if getattr(__main__, "__spec__", None) is not None:
        command = [sys.executable, "-m", __main__.__spec__.name]
    else:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    command += _config_flags(sys.argv[1:])
    command += task_overrides(hydra_cfg)
    command += [o for o in hydra_cfg.overrides.hydra if not o.lstrip("+~").startswith(_PARENT_ONLY)]
    output_dir = hydra_cfg.runtime.output_dir.replace("\\", "\\\\").replace('"', '\\"')
    command += [f'hydra.run.dir="{output_dir}"', "hydra.output_subdir=null"]
    return command, get_original_cwd()


# Lightning's launcher for local ranks (private: hpctrain.runtime.internals)
SUBPROCESS_LAUNCHER = "pytorch_lightning.strategies.launchers.subprocess_script._SubprocessScriptLauncher"


class HydraJobLauncher(LightningPart, lightning=SUBPROCESS_LAUNCHER):
    """Lightning's subprocess launcher, with the child command from `child_command`."""

    def _call_children_scripts(self) -> None:
        if not HydraConfig.initialized():
            super()._call_children_scripts()
            return
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        command, cwd = child_command()
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))
        failures.watch_children(self.procs)


class OneGPUPerTaskSLURMEnvironment(
    LightningPart, lightning="lightning_fabric.plugins.environments.SLURMEnvironment"
):
    """SLURM with one GPU bound to each task (--gpus-per-task=1, --gpu-bind=...): every process sees a
    single GPU, index 0, whatever its SLURM_LOCALID. The trainer then runs with devices=1 per process
    (see build.trainer) and the strategy's device is that one GPU (`_HydraLaunched.root_device`); the
    local rank stays SLURM_LOCALID, so what runs once per node (prepare_data, the GPU sampler) runs on
    one task of each node, not on all of them. Ranks and world size come from SLURM, and the preflight
    has already matched the tasks per node against trainer.devices."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        return None


class _HydraLaunched:
    """For strategies that start local ranks by re-running the script: start them as this Hydra job."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        namespace = self.namespace  # type: ignore[attr-defined]
        if type(self._launcher) is namespace.get(SUBPROCESS_LAUNCHER):  # type: ignore[has-type]
            launcher = namespace.part(HydraJobLauncher)
            self._launcher = launcher(self.cluster_environment, self.num_processes, self.num_nodes)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # the world size, not devices x nodes: with one GPU per task the trainer has devices=1 per process
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # type: ignore[attr-defined]

    @property
    def root_device(self) -> Any:
        # one GPU per task: the task's only device, whatever its local rank (parallel_devices has one entry)
        if isinstance(self.cluster_environment, OneGPUPerTaskSLURMEnvironment):  # type: ignore[attr-defined]
            return self.parallel_devices[0]  # type: ignore[attr-defined]
        return super().root_device  # type: ignore[misc]


class HydraDDPStrategy(_HydraLaunched, LightningPart, lightning="pytorch_lightning.strategies.DDPStrategy"):
    """Lightning's DDP ("ddp", not "ddp_spawn") with a Hydra-aware launcher for local ranks."""


def end_distributed_job(trainer, completed: bool = True) -> None:
    """Close the process group and reap local ranks: a clean exit, and a fresh start for a sweep's next job.

    After a completed run every rank stops its watchdog and then meets the others in a barrier, so no
    rank still watching sees rank 0's process end and takes it for a failure. Without closing the
    group, a process that exits with a live process group can abort in a C++ destructor ("terminate
    called without an active exception"), failing a job that trained fine.
    """
    watchdog.stop()
    if dist.is_available() and dist.is_initialized():
        if completed and trainer is not None:
            trainer.strategy.barrier("end_of_run")
            if dist.get_rank() > 0:
                watchdog.finished_worker()
        dist.destroy_process_group()
    launcher = getattr(trainer.strategy, "launcher", None) if trainer is not None else None
    if isinstance(launcher, HydraJobLauncher) and launcher.procs:
        if not completed:  # a failed job of a sweep: its local ranks must not outlive it
            leave_children_to_the_watchdog()
            launcher.kill(signal.SIGKILL)
        for proc in launcher.procs:
            proc.wait(timeout=120)
        for key in _LAUNCH_ENV:
            os.environ.pop(key, None)


def leave_children_to_the_watchdog() -> None:
    """Lightning's launcher watches the local ranks from a thread, every 5 s, and SIGKILLs this process
    (printing a line about zombies) when one of them ended with a non-zero code. hpctrain's watchdog
    watches them too, each second, and ends the job with the sentence that names the rank; the two would
    race, and Lightning's kill could take rank 0 before it reports. Once the watchdog runs, and before
    rank 0 ends its local ranks on purpose, Lightning's watcher is given no ranks to watch."""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer" and hasattr(thread, "_child_processes"):
            thread._child_processes = []  # an empty list reads as "all ended well": the thread stops


def lightning_cluster_environment(namespace: Namespace, env: Mapping[str, str] | None = None):
    """The Lightning cluster environment for this launcher, chosen here rather than auto-detected.

    SLURM gets `auto_requeue=False`: requeue on the time-limit signal is `hpctrain.runtime.distributed.requeue`'s job
    (Lightning's own handler saves a checkpoint inside the signal handler and deadlocks multi-node DDP),
    and a version that uses the task's one GPU when SLURM binds one GPU to each task.
    A bare sbatch script or salloc shell is treated as a plain local run. Of the run's Lightning `namespace`.
    """
    kind = launched.launcher(env)
    environments = "lightning_fabric.plugins.environments"
    if kind == launched.TORCHRUN:
        return namespace.get(f"{environments}.TorchElasticEnvironment")()
    if kind == launched.SLURM and allocated.one_gpu_per_task(env):
        return namespace.part(OneGPUPerTaskSLURMEnvironment)(auto_requeue=False)
    if kind == launched.SLURM:
        return namespace.get(f"{environments}.SLURMEnvironment")(auto_requeue=False)
    return namespace.get(f"{environments}.LightningEnvironment")()
