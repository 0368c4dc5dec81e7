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
- srun's `--kill-on-bad-exit=1`, and MASTER_ADDR / the job's MASTER_PORT exported on the first node, as
  slurm/train.sbatch does;
- the jobs run from a snapshot of the code taken at launch (hpctrain.runtime.snapshot), so a requeued
  job runs what was launched however the working copy changes; `snapshot=false` opts out;
- the sweep dir is resolved once, here, so every job writes under it (the config each job composes on
  its node would otherwise name its own sweep dir after its own job id);
- the launching command prints each job's SLURM id, run dir and log as soon as it is submitted, and a
  job that fails or dies is listed in the sweep's summary (not an exception ending the sweep);
- `hydra.launcher.pack=N`: the sweep's jobs N to an allocation, side by side on one node, each with the
  resources above, through the packed job's driver (hpctrain.runtime.sweeps.pack): submitit is not
  used, the launcher submits slurm/pack.sbatch as a job array itself, one task per N jobs, with a file
  of their overrides, waits for it, and reads each job's result from its outcome.yaml.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf, open_dict, read_write

from hpctrain.runtime import snapshot
from hpctrain.runtime.config.compose import CODE_ROOT, CONF_DIR, PROJECT_ROOT
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.environment import slurm_job
from hpctrain.runtime.environment.allocated import GPU_ACCELERATORS
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run import records
from hpctrain.runtime.run.job import skipped
from hpctrain.runtime.sweeps import pack as packed

log = logging.getLogger(__package__.split(".")[0])

TOPOLOGY = ("trainer.num_nodes", "trainer.devices", "trainer.accelerator", "trainer")
POLL_S = 2.0  # how often a packed sweep's launcher asks SLURM whether its jobs are still queued
# sbatch flags of hydra-submitit-launcher's keys that a packed job passes through as they are
PASSED = ("partition", "qos", "account", "comment", "constraint", "exclude", "cpus_per_gpu", "mem_per_gpu")


@dataclass
class PackableSlurmQueueConf(SlurmQueueConf):
    """hydra-submitit-launcher's keys, and `pack`: jobs side by side in one allocation (1: one each)."""

    _target_: str = "hydra_plugins.hpctrain_sweeps.SlurmLauncher"
    pack: int = 1


ConfigStore.instance().store(
    group="hydra/launcher", name="hpctrain_slurm", node=PackableSlurmQueueConf, provider="hpctrain"
)


def setup_lines(root_dir: str | None) -> list[str]:
    """What slurm/train.sbatch does before srun, from the same file (slurm/job_env.sh): the site's
    settings, then the first node's name and the job's port (from its id)."""
    job_env = Path(root_dir or ".") / "slurm" / "job_env.sh"
    return [f"source {shlex.quote(str(job_env))}"]


def _mtime(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.exists() else None


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
    @property
    def settings(self) -> Settings:
        """hpctrain's own settings of the sweep's config (the cluster preset and the requeue signal), checked."""
        return Settings.of(self.config)

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
        preset = self.settings.cluster
        if preset is not None and self.params.get("mem_gb") is None:
            wanted["mem_gb"] = int(preset.mem_per_task_gb * per_node)
        if gpus and preset is not None and preset.gpu_type:  # the site names GPU types in its GRES
            wanted["gpus_per_node"] = None
            wanted["gres"] = f"gpu:{preset.gpu_type}:{gpus}"
        return wanted

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        refuse_swept_topology(job_overrides)
        size = self._pack_size()
        if size > 1:
            return self._launch_packed(job_overrides, initial_job_idx, size)
        params = dict(self.params)
        params.pop("pack", None)
        params.update(self._allocation())
        for key in ("gpus_per_node", "mem_gb"):
            if params.get(key) is None:
                params.pop(key, None)
        requeue_signal = self.settings.requeue.signal
        lead_s = math.ceil(self.settings.requeue.signal_lead_s)
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

    # ------------------------------------------------------------------ hydra.launcher.pack=N

    def _pack_size(self) -> int:
        size = self.params.get("pack", 1)
        if not isinstance(size, int) or size < 1:
            raise UserError(
                f"hydra.launcher.pack={size} is not a number of jobs per allocation; pass hydra.launcher.pack=N "
                "with N >= 1 (1: one allocation per job)."
            )
        return size

    def _launch_packed(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, size: int
    ) -> list[JobReturn]:
        """The jobs `size` to an allocation: slurm/pack.sbatch as a job array, one task per `size` jobs, whose
        driver runs each job as slurm/train.sbatch in a step of its own (hpctrain.runtime.sweeps.pack)."""
        allocation = self._allocation()
        if allocation["nodes"] != 1:
            raise UserError(
                f"hydra.launcher.pack={size} puts {size} jobs side by side on one node, but trainer.num_nodes="
                f"{allocation['nodes']} asks for {allocation['nodes']} nodes per job; pack jobs that fit one node "
                "(trainer.num_nodes=1), or drop hydra.launcher.pack (one allocation per job)."
            )
        sweep = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep.mkdir(parents=True, exist_ok=True)
        if OmegaConf.select(self.config, "snapshot", default=True):
            code, _ = self._run_from_snapshot()
        else:
            code = CODE_ROOT
        jobs = [(n, self._as_point(o)) for n, o in enumerate(job_overrides, start=initial_job_idx)]
        results = {n: self._completed_before(sweep, n, point, allocation) for n, point in jobs}
        todo = [(n, point) for n, point in jobs if results[n] is None]
        if todo:
            size = min(size, len(todo))
            before = {n: _mtime(sweep / str(n) / records.OUTCOME_FILE) for n, _ in todo}  # an earlier sweep's
            array = self._submit_pack(code, sweep, todo, size, allocation)
            for i, (number, point) in enumerate(todo):
                log.info(
                    "job %d: SLURM job %s_%d  run dir %s/%d  log %s  (%s)",
                    number,
                    array,
                    i // size,
                    sweep,
                    number,
                    sweep / packed.JOBS_DIR / f"{array}_{i // size}.point{number}.out",
                    " ".join(filter_overrides(point)),
                )
            log.info("waiting for SLURM job %s: %d job(s), %d to an allocation", array, len(todo), size)
            while slurm_job.in_queue(array):
                time.sleep(POLL_S)
            for i, (number, point) in enumerate(todo):
                task = f"{array}_{i // size}"
                results[number] = self._packed_result(sweep, number, point, task, before[number])
        return [results[n] for n, _ in jobs]

    def _as_point(self, overrides: Sequence[str]) -> list[str]:
        """A job's overrides for slurm/train.sbatch, which chooses trainer=ddp unless told: the sweep's trainer."""
        trainer = OmegaConf.select(self.config, "hydra.runtime.choices.trainer")
        chosen = any(o.startswith("trainer=") for o in overrides)
        return [*([] if chosen or trainer is None else [f"trainer={trainer}"]), *overrides]

    def _completed_before(
        self, sweep: Path, number: int, point: list[str], allocation: dict[str, Any]
    ) -> JobReturn | None:
        """With skip_completed=true, the result of a job that completed in its run dir with the same config
        (as slurm/train.sbatch completes it: the counts from the allocation, the collective timeout)."""
        if not OmegaConf.select(self.config, "skip_completed", default=False):
            return None

        as_run = [
            "trainer.num_nodes=1",
            f"trainer.devices={allocation['tasks_per_node']}",
            f"dist.timeout_min={os.environ.get('COLLECTIVE_TIMEOUT_MIN', '30')}",
            *point,
        ]
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, as_run)
        with open_dict(cfg):
            del cfg["hydra"]  # not signed, and it cannot be resolved here (no job number yet)
        done = records.completed_with(sweep / str(number), records.config_signature(cfg))
        if done is None:
            return None
        skipped().append(number)
        log.info("job %d: already completed in %s with the same config; skipped", number, sweep / str(number))
        return self._returned(sweep, number, point, done.get("value"))

    def _submit_pack(
        self,
        code: Path,
        sweep: Path,
        todo: list[tuple[int, list[str]]],
        size: int,
        allocation: dict[str, Any],
    ) -> str:
        """sbatch slurm/pack.sbatch --array=0-<packs - 1> --pack=<size> --jobs=<file>; the array's job id."""
        params = self.params
        requeue_signal = self.settings.requeue.signal
        lead_s = math.ceil(self.settings.requeue.signal_lead_s)
        extra: dict[str, Any] = {"signal": f"{requeue_signal}@{lead_s}", "requeue": True}
        extra.update(params.get("additional_parameters") or {})
        gpus, gres = allocation.get("gpus_per_node"), allocation.get("gres")
        mem_gb = params.get("mem_gb") or allocation.get("mem_gb")
        if gres:  # gpu:<type>:<per job>
            kind, per_job = gres.rsplit(":", 1)
            gres = f"{kind}:{int(per_job) * size}"
        flags = {
            "job-name": params.get("name") or "pack",
            "nodes": 1,
            "ntasks-per-node": allocation["tasks_per_node"] * size,
            "gres": gres or (f"gpu:{gpus * size}" if gpus else params.get("gres") or "none"),
            "cpus-per-task": params.get("cpus_per_task"),
            "mem": f"{int(mem_gb) * size}G" if mem_gb else None,  # per job (node), as without packing
            "time": params.get("timeout_min"),
            "array": f"0-{math.ceil(len(todo) / size) - 1}%{params.get('array_parallelism') or 256}",
            "output": sweep / packed.JOBS_DIR / "%A_%a.out",
            "chdir": code,
            **{key.replace("_", "-"): params.get(key) for key in PASSED},
            **{key.replace("_", "-"): value for key, value in extra.items()},
        }
        jobs_file = packed.write_jobs(sweep, todo, todo[0][0])
        command = [
            "sbatch",
            "--parsable",
            *(f"--{k}" if v is True else f"--{k}={v}" for k, v in flags.items() if v not in (None, False)),
            str(code / "slurm" / "pack.sbatch"),
            f"--pack={size}",
            f"--jobs={jobs_file}",
        ]

        env = {
            **os.environ,
            "HPCTRAIN_PROJECT_ROOT": str(PROJECT_ROOT),
            "PYTHON": sys.executable,  # the launcher's interpreter runs the driver and the jobs, as submitit's
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        setup = params.get("setup") or []
        if setup:
            env["HPCTRAIN_CLUSTER_SETUP"] = "\n".join(setup)  # run by slurm/job_env.sh
        log.info("%s", shlex.join(command))
        submitted = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if submitted.returncode != 0:
            raise UserError(
                f"sbatch refused the packed jobs ({(submitted.stderr or submitted.stdout).strip()}); fix the "
                "hydra.launcher settings it names, or drop hydra.launcher.pack."
            )
        return submitted.stdout.strip().split(";")[0]

    def _packed_result(
        self, sweep: Path, number: int, point: list[str], task: str, before: int | None
    ) -> JobReturn:
        """A packed job's result, from the outcome.yaml it wrote: its value, or None when it did not complete
        (said, and listed in the sweep's summary, as a job that fails without packing)."""
        written = _mtime(sweep / str(number) / records.OUTCOME_FILE) not in (None, before)
        outcome = records.read_outcome(sweep / str(number)) if written else {}
        status = outcome.get("status") or "not run (no outcome.yaml written)"
        if status != "completed":
            reason = " ".join(str(outcome.get("error") or "").split())[:300]
            log.error(
                "job %d (SLURM job %s) %s%s (log: %s)",
                number,
                task,
                status,
                f": {reason}" if reason else "",
                sweep / packed.JOBS_DIR / f"{task}.point{number}.out",
            )
        return self._returned(sweep, number, point, outcome.get("value") if status == "completed" else None)

    def _returned(self, sweep: Path, number: int, point: list[str], value: Any) -> JobReturn:
        returned = JobReturn(
            overrides=point,
            working_dir=str(sweep / str(number)),
            task_name=str(OmegaConf.select(self.config, "hydra.job.name", default="")),
            status=JobStatus.COMPLETED,
        )
        returned.return_value = value
        return returned

    def _run_from_snapshot(self) -> tuple[Path, list[str]]:
        """A snapshot of the code now (hpctrain.runtime.snapshot), which every job runs, requeued attempts
        included: its src/ first on the path, its conf/ where the jobs compose their config (the search
        path the jobs receive is rewritten from the project's conf/ to the snapshot's), the project named
        for logs/, data/ and the venv."""

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
