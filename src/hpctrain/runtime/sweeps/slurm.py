"""`hydra/launcher=slurm`: every job of a sweep as a SLURM job, through hydra-submitit-launcher, with
the guarantees of `sbatch slurm/train.sbatch`.

    python src/train.py -m hydra/launcher=slurm trainer=ddp trainer.num_nodes=2 trainer.devices=4 \\
        model.optimizer.lr=0.1,0.01

What this adds to hydra-submitit-launcher 1.2:
- the allocation comes from the trainer: nodes = trainer.num_nodes, tasks per node = trainer.devices
  (one task per device), GPUs per node = trainer.devices on GPU trainers; the launcher submits one
  allocation for the whole sweep, so sweeping those values is refused with a sentence; the rest is the
  cluster preset's request, scripts/submit.py's (config/slurm_request.py), unless hydra.launcher sets it;
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
from hpctrain.runtime.config.slurm_request import as_run, packed_request, slurm_request
from hpctrain.runtime.environment import slurm_job
from hpctrain.runtime.environment.allocated import GPU_ACCELERATORS
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run.job import skipped
from hpctrain.runtime.storage import records
from hpctrain.runtime.sweeps import pack as packed

log = logging.getLogger(__package__.split(".")[0])

TOPOLOGY = ("trainer.num_nodes", "trainer.devices", "trainer.accelerator", "trainer")
POLL_S = 2.0  # how often a packed sweep's launcher asks SLURM whether its jobs are still queued
# sbatch flags of hydra-submitit-launcher's keys that a packed job passes through as they are
PASSED = ("comment", "constraint", "exclude", "cpus_per_gpu", "mem_per_gpu")
# hydra-submitit-launcher's keys that set a flag of the request (config/slurm_request.py) where not null
# submitit's own names of its parameters; the others go to sbatch as slurm_<key>
SUBMITIT_KEYS = ("timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name")
REQUEST_KEYS = {"timeout_min": "time", "cpus_per_task": "cpus-per-task", "mem_gb": "mem"} | {
    key: key for key in ("partition", "account", "qos")
}


@dataclass
class PackableSlurmQueueConf(SlurmQueueConf):
    """hydra-submitit-launcher's keys, and `pack`: jobs side by side in one allocation (1: one each)."""

    _target_: str = "hydra_plugins.hpctrain_sweeps.SlurmLauncher"
    timeout_min: int | None = None  # null: the cluster preset's
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

    def request(self) -> dict[str, str]:
        """One job's sbatch flags: nodes and tasks from the trainer, the rest the cluster preset's (cluster=NAME;
        none: the defaults), where hydra.launcher.<key> does not set it."""
        trainer = self.config.trainer
        try:
            nodes, per_node = int(trainer.num_nodes), int(trainer.devices)
        except (TypeError, ValueError) as err:
            raise UserError(
                f"the SLURM launcher needs numbers of nodes and devices, not trainer.num_nodes={trainer.num_nodes} "
                f"trainer.devices={trainer.devices}; pass e.g. trainer.num_nodes=2 trainer.devices=4."
            ) from err
        gpus = str(trainer.accelerator) in GPU_ACCELERATORS
        counts = {"nodes": nodes, "tasks_per_node": per_node, "gpus_per_node": per_node if gpus else None}
        for key, value in counts.items():
            given = self.params.get(key)
            if given not in (None, value):
                raise UserError(
                    f"hydra.launcher.{key}={given} disagrees with the trainer ({value}); drop it: it is "
                    "derived from trainer.num_nodes and trainer.devices."
                )
        given = {
            flag: f"{value}G" if key == "mem_gb" else str(value)  # mem_gb: GB per node
            for key, flag in REQUEST_KEYS.items()
            if (value := self.params.get(key)) is not None
        }
        return slurm_request(self.settings.cluster, nodes, per_node, gpus) | given

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        refuse_swept_topology(job_overrides)
        size = self._pack_size()
        if size > 1:
            return self._launch_packed(job_overrides, initial_job_idx, size)
        request = self.request()
        params = {k: v for k, v in self.params.items() if k not in (*REQUEST_KEYS, "gpus_per_node", "pack")}
        params["timeout_min"] = int(request["time"])  # nodes and tasks_per_node: the trainer's, checked
        flags = {flag.replace("-", "_"): value for flag, value in request.items()}  # submit.py's, as they are
        params["additional_parameters"] = {**flags, **self._signal_flags()}
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
        params["srun_args"] = ["--kill-on-bad-exit=1"]
        executor.update_parameters(
            **{k if k in SUBMITIT_KEYS else f"slurm_{k}": v for k, v in params.items()}
        )

        Path(self._sweep_dir).mkdir(parents=True, exist_ok=True)
        job_params = [
            (list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state())
            for number, overrides in enumerate(job_overrides, start=initial_job_idx)
        ]
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

    def _signal_flags(self) -> dict[str, Any]:
        """--signal=<requeue.signal>@<lead> --requeue (not submitit's USR2), then additional_parameters, which win."""
        requeue = self.settings.requeue
        signal = f"{requeue.signal}@{math.ceil(requeue.signal_lead_s)}"
        return {"signal": signal, "requeue": True, **(self.params.get("additional_parameters") or {})}

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
        request = self.request()
        if request["nodes"] != "1":
            raise UserError(
                f"hydra.launcher.pack={size} puts {size} jobs side by side on one node, but trainer.num_nodes="
                f"{request['nodes']} asks for {request['nodes']} nodes per job; pack jobs that fit one node "
                "(trainer.num_nodes=1), or drop hydra.launcher.pack (one allocation per job)."
            )
        sweep = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep.mkdir(parents=True, exist_ok=True)
        if OmegaConf.select(self.config, "snapshot", default=True):
            code, _ = self._run_from_snapshot()
        else:
            code = CODE_ROOT
        jobs = [(n, self._as_point(o)) for n, o in enumerate(job_overrides, start=initial_job_idx)]
        results = {n: self._completed_before(sweep, n, point, request) for n, point in jobs}
        todo = [(n, point) for n, point in jobs if results[n] is None]
        if todo:
            size = min(size, len(todo))
            before = {n: _mtime(sweep / str(n) / records.OUTCOME_FILE) for n, _ in todo}  # an earlier sweep's
            array = self._submit_pack(code, sweep, todo, size, packed_request(request, size))
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
        self, sweep: Path, number: int, point: list[str], request: dict[str, str]
    ) -> JobReturn | None:
        """With skip_completed=true, the result of a job that completed in its run dir with the same config
        (as slurm/train.sbatch completes it: the counts from the allocation, the collective timeout)."""
        if not OmegaConf.select(self.config, "skip_completed", default=False):
            return None

        completed = as_run(point, 1, request["ntasks-per-node"])
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, completed)
        with open_dict(cfg):
            del cfg["hydra"]  # not signed, and it cannot be resolved here (no job number yet)
        done = records.completed_with(sweep / str(number), records.config_signature(cfg))
        if done is None:
            return None
        skipped().append(number)
        log.info("job %d: already completed in %s with the same config; skipped", number, sweep / str(number))
        return self._returned(sweep, number, point, done.get("value"))

    def _submit_pack(
        self, code: Path, sweep: Path, todo: list[tuple[int, list[str]]], size: int, request: dict[str, str]
    ) -> str:
        """sbatch slurm/pack.sbatch --array=0-<packs - 1> --pack=<size> --jobs=<file> for `request`; the job id."""
        params = self.params
        flags = {
            "job-name": params.get("name") or "pack",
            **request,
            "array": f"0-{math.ceil(len(todo) / size) - 1}%{params.get('array_parallelism') or 256}",
            "output": sweep / packed.JOBS_DIR / "%A_%a.out",
            "chdir": code,
            **{key.replace("_", "-"): params[key] for key in PASSED if params.get(key) is not None},
            **{key.replace("_", "-"): value for key, value in self._signal_flags().items()},
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
