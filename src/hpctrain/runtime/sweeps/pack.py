"""A packed job: several points of a sweep grid side by side in one allocation (`scripts/submit.py --sweep
--pack N`). slurm/pack.sbatch runs `main` (scripts/pack.py) as the job's one process, the pack's driver:

    python scripts/pack.py --pack=2 [--points=1,3,5] model.optimizer.lr=0.1,0.01 seed=1,2
    python scripts/pack.py --pack=2 --jobs=<sweep dir>/.pack/jobs-0.yaml      # the SLURM launcher's

- Array task k runs points k*N ... k*N+N-1 of the grid, in Hydra's job order (`--points`: of those job
  numbers, the missing points of an earlier sweep), into <sweep dir>/<job number>/, the run dirs a job
  array's tasks use: scripts/summarize.py summarises either. With `--jobs`, the points are the jobs a
  file lists (`write_jobs`: the sweep dir, then each job's number and overrides), as the SLURM launcher
  (`hydra/launcher=slurm hydra.launcher.pack=N`) receives them from any sweeper: Optuna's are no grid.
- Each point is slurm/train.sbatch, run as its own `srun --exact` step on its share of the node (its
  tasks, CPUs, memory and GPUs: `pack_shares.pack_share`), with its own run dir, resume and outcome, and its
  output in <the job's output>.point<n>.out. A point that fails ends alone; the others go on.
- The requeue signal reaches every step (SLURM signals the steps, not the batch script; a signal that
  reaches the driver is passed on to them). Each point saves its requeue.ckpt and ends, recorded as
  requeued in its outcome.yaml, without requeueing: `scontrol requeue` requeues a whole allocation. Once
  every point has saved or ended, the driver requeues the job, once; the restarted job runs only the points
  that did not complete, fail or stop in it, each continuing from its own checkpoint. Points still running
  when the time limit is TIME_LIMIT_MARGIN_S away are not waited for (they continue from their last one).
- The requeue budget (`requeue.max_attempts`) counts the allocation's attempts (SLURM's restart count):
  every point checks it before saving for the requeue, and stops, saying so, when it is spent.

No torch import: the driver only starts its points and waits for them.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpctrain.runtime import confined
from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.environment import launched, pack_shares, slurm_job
from hpctrain.runtime.errors import UserError, reported_as_one_sentence
from hpctrain.runtime.storage import records
from hpctrain.runtime.sweeps.grid import expand

TRAIN_SBATCH = Path("slurm") / "train.sbatch"  # in the code the job runs: its working directory
POLL_S = 1.0
REQUEUE_WAIT_S = 120  # as requeue.requeue_and_wait: SLURM ends the requeued job before this
TIME_LIMIT_MARGIN_S = 30  # a point still running this close to the time limit is not waited for
FINAL = ("completed", "failed", "stopped")  # a point that ended so in this job is not run again in it
STOPPED_BY_SIGTERM = f"exit status {128 + signal.SIGTERM}"  # scancel, preemption: it runs again
PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)  # the requeue signal, reaching the driver: for the points


def say(message: str) -> None:
    print(f"pack: {message}", flush=True)


@dataclass
class Point:
    number: int
    overrides: list[str]
    run_dir: Path
    output: Path
    process: subprocess.Popen[bytes] | None = None
    outcome_before: int | None = None  # outcome.yaml's mtime when the point started in this attempt
    ending: str = ""  # how it ended: outcome.yaml's status, `refused` or `failed`
    detail: str = ""

    def ended_in(self, job: str | None) -> str | None:
        """How the point ended for good in an earlier attempt of this job (outcome.yaml), if it did."""
        attempts = records.read_run_record(self.run_dir).get("attempts") or []
        outcome = records.read_outcome(self.run_dir)
        if not attempts or job is None or str(attempts[-1].get("slurm_job_id")) != job:
            return None
        if str(outcome.get("finished", "")) < str(attempts[-1].get("started", "")):
            return None  # written by an earlier job (a re-run into an earlier sweep's dir)
        status = outcome.get("status")
        return status if status in FINAL and outcome.get("error") != STOPPED_BY_SIGTERM else None

    def start(self, share: pack_shares.PackShare) -> None:
        outcome = self.run_dir / records.OUTCOME_FILE
        self.outcome_before = outcome.stat().st_mtime_ns if outcome.exists() else None
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with open(self.output, "ab") as output:
            self.process = subprocess.Popen(
                ["bash", str(TRAIN_SBATCH), *self.overrides, f"hydra.run.dir={self.run_dir}"],
                stdout=output,
                stderr=subprocess.STDOUT,
                env=pack_shares.pack_step_env(share, self.number, self.output),
                # SLURM signals the steps' tasks itself; a signal sent to the whole batch step (scancel
                # --full) must not end the shell and srun that wait for them
                preexec_fn=_ignore_job_signals,  # the driver runs no threads
            )

    def finished(self) -> bool:
        """Whether its step has ended; the first time it has, how (said once)."""
        if self.process is None:  # not run in this attempt
            return True
        if self.process.poll() is None:
            return False
        if not self.ending:
            self.ending, self.detail = self._how_it_ended(self.process.returncode)
            say(f"point {self.number} ended: {self.ending}" + (f" ({self.detail})" if self.detail else ""))
        return True

    def _how_it_ended(self, code: int) -> tuple[str, str]:
        outcome = self.run_dir / records.OUTCOME_FILE
        written = records.read_outcome(self.run_dir) if outcome.exists() else {}
        if written.get("status") and outcome.stat().st_mtime_ns != self.outcome_before:
            return str(written["status"]), str(written.get("error") or "")
        if code == 0:
            return "completed", ""
        if code == 2:  # refused before it ran: its one sentence is in its output
            return "refused", f"see {self.output}"
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        lost = f"its step ended ({how}) without a record of how it ended; see {self.output}"
        if (self.run_dir / "run.yaml").exists():
            records.record_lost(self.run_dir, lost)
        return "failed", lost


def _ignore_job_signals() -> None:
    for sig in (*PASSED_ON, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


@dataclass
class Args:
    size: int
    numbers: list[int] | None  # --points
    jobs: Path | None  # --jobs
    overrides: list[str]


def parse(argv: list[str]) -> Args:
    """--pack=N, then --points=i,j,... and the overrides (a sweep grid), or --jobs=<file> (`write_jobs`)."""
    size: int | None = None
    numbers: list[int] | None = None
    jobs: Path | None = None
    rest = list(argv)
    while rest and rest[0].startswith(("--pack=", "--points=", "--jobs=")):
        flag = rest.pop(0)
        key, value = flag[2:].split("=", 1)
        try:
            if key == "pack":
                size = int(value)
            elif key == "jobs":
                jobs = Path(value)
            else:
                numbers = [int(n) for n in value.split(",") if n]
        except ValueError:
            raise UserError(
                f"{flag} is not a number of points or a list of job numbers; pass e.g. --pack=4 --points=0,2,5."
            ) from None
    if size is None or size < 1:
        given = "no --pack" if size is None else f"--pack={size}"
        raise UserError(
            f"slurm/pack.sbatch needs --pack=N (N >= 1 points side by side) before the overrides, not {given}; "
            "submit with python scripts/submit.py --sweep --pack N -- <overrides>."
        )
    if jobs is not None and (rest or numbers is not None):
        raise UserError(
            f"--jobs={jobs} lists the points and their overrides, but {' '.join(rest) or '--points'} was "
            "given too; pass either --jobs=<file> or --points and a sweep grid."
        )
    return Args(size, numbers, jobs, rest)


JOBS_DIR = ".pack"  # in the sweep dir: the SLURM launcher's files of jobs, and its packs' output


def write_jobs(sweep: Path, jobs: list[tuple[int, list[str]]], first: int) -> Path:
    """The file of jobs a packed job runs with --jobs: the sweep dir, then each job's number and overrides
    (what the SLURM launcher was given for it), in <sweep dir>/.pack/jobs-<first job>.yaml."""
    path = sweep / JOBS_DIR / f"jobs-{first}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    listed = {"sweep_dir": str(sweep), "jobs": [{"number": n, "overrides": list(o)} for n, o in jobs]}
    path.write_text(yaml.safe_dump(listed, sort_keys=False))
    return path


def read_jobs(path: Path) -> tuple[Path, list[tuple[int, list[str]]]]:
    """The sweep dir and the jobs a file of `write_jobs` lists; one sentence if it cannot be read."""
    try:
        listed = confined.read_yaml(path) or {}
        jobs = [(int(j["number"]), [str(o) for o in j["overrides"]]) for j in listed["jobs"]]
        return Path(listed["sweep_dir"]), jobs
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"--jobs={path} is not a file of jobs the SLURM launcher wrote ({type(err).__name__}: {err}); "
            "launch the sweep again (hydra/launcher=slurm hydra.launcher.pack=N)."
        ) from None


def points_of_this_task(grid: int, size: int, numbers: list[int] | None) -> list[int]:
    """The job numbers this array task runs: its pack of `size` of `numbers` (every point of the grid)."""
    numbers = list(range(grid)) if numbers is None else numbers
    outside = [n for n in numbers if not 0 <= n < grid]
    if outside:
        raise UserError(
            f"--points names job {outside[0]}, but the sweep grid has {grid} point(s) (jobs 0 to {grid - 1})."
        )
    packs = math.ceil(len(numbers) / size)
    task, tasks, first, last = launched.array_task()
    if (tasks is None and packs != 1) or (tasks is not None and (tasks != packs or first != "0")):
        given = (
            f"a job array of {tasks} task(s) (--array={first}-{last})" if tasks else "one job, not an array"
        )
        raise UserError(
            f"{len(numbers)} point(s), {size} to a job, make {packs} job(s), but this is {given}; submit with "
            f"--array=0-{packs - 1} (python scripts/submit.py --sweep --pack {size} computes it)."
        )
    return numbers[task * size : (task + 1) * size]


def sweep_dir(points: list[list[str]]) -> Path:
    """Where the points' run dirs go: logs/<task>/multiruns/slurm-<array job id>/, as for a job array's
    tasks, or the earlier sweep's dir whose missing points these are."""
    resumed = launched.resumed_sweep_dir()
    if resumed is not None:
        return resumed
    ids = launched.slurm_ids()
    cfg = _composed(points)
    name = f"slurm-{ids['slurm_array_job_id'] or ids['slurm_job_id']}"
    return (Path(str(cfg.paths.log_dir)) / str(cfg.task_name) / "multiruns" / name).resolve()


def _composed(points: list[list[str]]) -> Any:
    for overrides in points:
        try:
            return compose("train", overrides)
        except Exception:  # a point its own step refuses, in one sentence; another one says where logs go
            continue
    return compose("train", [o for o in points[0] if o.startswith(("paths.", "task_name="))])


def output_file(number: int, sweep: Path) -> Path:
    """Where a point's output goes: beside the job's, <job output>.point<n>.out."""
    job_output = slurm_job.slurm_output_file()
    if not job_output:
        return sweep / f"point{number}.out"
    path = Path(job_output)
    return path.with_name(f"{path.stem}.point{number}{path.suffix or '.out'}")


def main(argv: list[str]) -> int:
    with reported_as_one_sentence():
        args = parse(argv)
        if args.jobs is not None:  # the SLURM launcher's: job numbers and overrides as it received them
            sweep, listed = read_jobs(args.jobs)
            mine = [listed[i][0] for i in points_of_this_task(len(listed), args.size, None)]
            overrides_of = dict(listed)
            whole = f"the {len(listed)} in {args.jobs.name}"
        else:
            grid = expand(args.overrides)
            mine = points_of_this_task(len(grid), args.size, args.numbers)
            overrides_of = dict(enumerate(grid))
            whole = str(len(grid))
        share = pack_shares.pack_share(args.size)
        if args.jobs is None:
            sweep = sweep_dir([overrides_of[n] for n in mine])
    job = launched.slurm_job_id()
    everyone = list(overrides_of.values())
    points = [Point(n, overrides_of[n], sweep / str(n), output_file(n, sweep)) for n in mine]
    received: list[int] = []
    for sig in (*PASSED_ON, signal.SIGTERM):  # recorded; the driver waits for its points whatever comes
        signal.signal(sig, lambda signum, frame: received.append(signum))

    say(
        f"SLURM job {job} (attempt {launched.restart_count() + 1}): points {', '.join(map(str, mine))} of "
        f"{whole}, side by side, each {share.describe()}; run dirs in {sweep}"
    )
    for point in points:
        ended = point.ended_in(job)
        if ended:
            point.ending = ended
            say(f"point {point.number} {ended} in an earlier attempt of this job: not run again")
            continue
        point.start(share)
        swept = [
            o for o in point.overrides if any(o not in other for other in everyone)
        ]  # what sets it apart
        say(f"point {point.number} ({' '.join(swept) or 'the only one'}): output in {point.output}")

    waited_out = wait(points, received)
    if signal.SIGTERM in received:
        say("stopped by SIGTERM: every point saved (if training) and ended; nothing requeued")
        return 128 + signal.SIGTERM
    if any(p.ending == "requeued" for p in points):
        return requeue(job, points, waited_out)
    completed = [p for p in points if p.ending == "completed"]
    say(
        f"{len(completed)} of {len(points)} point(s) completed"
        + "".join(f"; point {p.number} {p.ending}" for p in points if p.ending != "completed")
        + f"; summarise the sweep with python scripts/summarize.py {sweep}"
    )
    return 0 if len(completed) == len(points) else 1


def wait(points: list[Point], received: list[int]) -> list[Point]:
    """Until every point has ended; a signal that reached the driver is passed on to them. Returns the
    points still running when the time limit came too close to wait for them (once one saved to requeue)."""
    passed_on = 0
    end = slurm_job.job_end_time()
    while not all(p.finished() for p in points):
        for signum in received[passed_on:]:
            if signum in PASSED_ON:
                slurm_job.signal_steps(signal.Signals(signum).name)
        passed_on = len(received)
        requeueing = any(p.ending == "requeued" for p in points)
        if requeueing and end is not None and time.time() > end - TIME_LIMIT_MARGIN_S:
            return [p for p in points if not p.finished()]
        time.sleep(POLL_S)
    return []


def requeue(job: str | None, points: list[Point], waited_out: list[Point]) -> int:
    """The allocation's one requeue, once every point has saved or ended; SLURM then ends this attempt."""
    again = [p.number for p in points if p.ending not in FINAL or p.detail == STOPPED_BY_SIGTERM]
    if waited_out:
        say(
            f"point(s) {', '.join(str(p.number) for p in waited_out)} still running {TIME_LIMIT_MARGIN_S} s before "
            "the time limit: not waited for (they continue from their last checkpoint)"
        )
    result = slurm_job.requeue_job()
    if result.returncode != 0:
        say(f"error: scontrol requeue {job} failed: {(result.stderr or result.stdout).strip()}")
        return 1
    say(
        f"requeued SLURM job {job} once its points had saved or ended; point(s) {', '.join(map(str, again))} run again"
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(REQUEUE_WAIT_S)  # SLURM ends this attempt; exiting first could record the job as failed
    return 1
