"""`hydra/launcher=slurm`: every job of a sweep as a SLURM job, through hydra-submitit-launcher, with
the guarantees of `sbatch slurm/train.sbatch`.

    python src/train.py -m hydra/launcher=slurm trainer=ddp trainer.num_nodes=2 trainer.devices=4 \\
        model.optimizer.lr=0.1,0.01

What this adds to hydra-submitit-launcher 1.2:
- the allocation comes from the trainer: nodes = trainer.num_nodes, tasks per node = trainer.devices
  (one task per device), GPUs per node = trainer.devices on GPU trainers; the launcher submits one
  allocation for the whole sweep, so sweeping those values is refused with a sentence;
- one owner for the time limit: the template. Jobs get `--signal=<requeue.signal>@<requeue.signal_lead_s>
  --requeue` instead of submitit's USR2, which therefore never arrives, and the template's handlers (installed
  when each job starts) checkpoint, `scontrol requeue` the array task and resume it in the same run
  dir. submitit's own resubmission is never used: it would start the job over with another job id
  (another run dir) and, with Lightning, the checkpoint would be taken inside a signal handler;
- srun's `--kill-on-bad-exit=1`, and MASTER_ADDR / a free MASTER_PORT exported on the first node, as
  slurm/train.sbatch does;
- the jobs run from a snapshot of the code taken at launch (hpctrain.runtime.snapshot), so a requeued
  job runs what was launched however the working copy changes; `snapshot=false` opts out;
- the sweep dir is resolved once, here, so every job writes under it (the config each job composes on
  its node would otherwise name its own sweep dir after its own job id);
- the launching command prints each job's SLURM id, run dir and log as soon as it is submitted, and a
  job that fails or dies is listed in the sweep's summary (not an exception ending the sweep).
"""

from __future__ import annotations

import logging
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf, open_dict, read_write

from hpctrain.runtime.cluster import GPU_ACCELERATORS
from hpctrain.runtime.errors import UserError

log = logging.getLogger(__package__.split(".")[0])

TOPOLOGY = ("trainer.num_nodes", "trainer.devices", "trainer.accelerator", "trainer")


def setup_lines(root_dir: str | None) -> list[str]:
    """What slurm/train.sbatch does before srun, from the same file (slurm/job_env.sh): the site's
    settings, then the first node's name and a port free on it (asked of this interpreter)."""
    job_env = Path(root_dir or ".") / "slurm" / "job_env.sh"
    return [f"export PYTHON={shlex.quote(sys.executable)}", f"source {shlex.quote(str(job_env))}"]


def refuse_swept_topology(job_overrides: Sequence[Sequence[str]]) -> None:
    """One allocation serves the whole sweep, so the values that size it must not vary between jobs."""
    for key in TOPOLOGY:
        values = {o.split("=", 1)[1] for job in job_overrides for o in job if o.split("=", 1)[0] == key}
        if len(values) > 1:
            raise UserError(
                f"{key} takes {len(values)} values in this sweep ({', '.join(sorted(values))}), but the SLURM "
                "launcher requests one allocation for all its jobs; run one sweep per value."
            )


class SlurmLauncher(SubmititSlurmLauncher):
    def _allocation(self) -> dict[str, Any]:
        trainer = self.config.trainer
        try:
            nodes, per_node = int(trainer.num_nodes), int(trainer.devices)
        except (TypeError, ValueError) as err:
            raise UserError(
                f"the SLURM launcher needs numbers of nodes and devices, not trainer.num_nodes={trainer.num_nodes} "
                f"trainer.devices={trainer.devices}; pass e.g. trainer.num_nodes=2 trainer.devices=4."
            ) from err
        gpus = per_node if str(trainer.accelerator) in GPU_ACCELERATORS else None
        wanted: dict[str, Any] = {"nodes": nodes, "tasks_per_node": per_node, "gpus_per_node": gpus}
        for key, value in wanted.items():
            given = self.params.get(key)
            if given not in (None, value):
                raise UserError(
                    f"hydra.launcher.{key}={given} disagrees with the trainer ({value}); drop it: it is "
                    "derived from trainer.num_nodes and trainer.devices."
                )
        preset = OmegaConf.select(self.config, "cluster") or {}
        if self.params.get("mem_gb") is None and preset.get("mem_per_task_gb"):
            wanted["mem_gb"] = int(preset.mem_per_task_gb) * per_node
        if gpus and preset.get("gpu_type"):  # the site names GPU types in its GRES
            wanted["gpus_per_node"] = None
            wanted["gres"] = f"gpu:{preset.gpu_type}:{gpus}"
        return wanted

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        refuse_swept_topology(job_overrides)
        params = dict(self.params)
        params.update(self._allocation())
        for key in ("gpus_per_node", "mem_gb"):
            if params.get(key) is None:
                params.pop(key, None)
        requeue_signal = str(OmegaConf.select(self.config, "requeue.signal", default="SIGUSR1"))
        lead_s = math.ceil(float(OmegaConf.select(self.config, "requeue.signal_lead_s", default=90)))
        extra = dict(params.pop("additional_parameters", None) or {})
        extra.setdefault("signal", f"{requeue_signal}@{lead_s}")  # the template's, replacing submitit's USR2
        extra.setdefault("requeue", True)
        params["additional_parameters"] = extra
        root_dir = OmegaConf.select(self.config, "paths.root_dir")
        code_lines: list[str] = []
        if OmegaConf.select(self.config, "snapshot", default=True):
            code, code_lines = self._run_from_snapshot()
            root_dir = str(code)
        params["setup"] = [*code_lines, *setup_lines(root_dir), *(params.get("setup") or [])]
        self._sweep_dir = str(self.config.hydra.sweep.dir)

        folder = params.pop("submitit_folder")
        executor = submitit.AutoExecutor(
            cluster="slurm", folder=folder, slurm_max_num_timeout=params.pop("max_num_timeout", 0)
        )
        shared = {
            "timeout_min",
            "cpus_per_task",
            "gpus_per_node",
            "tasks_per_node",
            "mem_gb",
            "nodes",
            "name",
        }
        params["srun_args"] = ["--kill-on-bad-exit=1"]
        executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items()})

        Path(self._sweep_dir).mkdir(parents=True, exist_ok=True)
        job_params = []
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_params.append(
                (list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state())
            )
        jobs = executor.map_array(self, *zip(*job_params, strict=True))
        for (overrides, _, number, _, _), job in zip(job_params, jobs, strict=True):
            log.info(
                "job %d: SLURM job %s  run dir %s/%d  log %s  (%s)",
                number,
                job.job_id,
                self._sweep_dir,
                number,
                job.paths.stdout,
                " ".join(filter_overrides(overrides)),
            )
        return [self._result(job, number) for (_, _, number, _, _), job in zip(job_params, jobs, strict=True)]

    def _run_from_snapshot(self) -> tuple[Path, list[str]]:
        """A snapshot of the code now (hpctrain.runtime.snapshot), which every job runs, requeued attempts
        included: its src/ first on the path, its conf/ where the jobs compose their config (the search
        path the jobs receive is rewritten from the project's conf/ to the snapshot's), the project named
        for logs/, data/ and the venv."""
        from hpctrain.runtime import snapshot
        from hpctrain.runtime.config.compose import CODE_ROOT, CONF_DIR, PROJECT_ROOT

        try:
            code = snapshot.take(CODE_ROOT).path
        except RuntimeError as err:
            raise UserError(f"{err} (or pass snapshot=false)") from err
        for element in self.hydra_context.config_loader.get_search_path().get_path():
            if element.path.removeprefix("file://") == str(CONF_DIR):
                element.path = f"file://{code / 'conf'}"
        log.info("the jobs run from a snapshot of the code: %s", code)
        return code, [
            f"export HPCTRAIN_PROJECT_ROOT={shlex.quote(str(PROJECT_ROOT))}",
            f"cd {shlex.quote(str(code))}",
            f"export PYTHONPATH={shlex.quote(str(code / 'src'))}${{PYTHONPATH:+:$PYTHONPATH}}",
        ]

    @staticmethod
    def _result(job: Any, number: int) -> JobReturn:
        """The job's return, or a failed JobReturn saying why (a dead job must not end the sweep)."""
        try:
            return job.results()[0]
        except Exception as err:
            reason = " ".join(str(err).split())[:300]
            log.error(
                "job %d (SLURM job %s) failed: %s (log: %s)", number, job.job_id, reason, job.paths.stdout
            )
            failed = JobReturn()
            failed.status = JobStatus.FAILED
            failed._return_value = err
            return failed

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn:
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        with open_dict(sweep_config.hydra.job) as job:
            job.id = submitit.JobEnvironment().job_id
            sweep_config.hydra.job.num = job_num
        with read_write(sweep_config.hydra.sweep):
            sweep_config.hydra.sweep.dir = self._sweep_dir  # the launching process's, for every job
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=sweep_config,
            job_dir_key=job_dir_key,
            job_subdir_key="hydra.sweep.subdir",
        )
