"""A run's attempts: what each one did, when the requeue budget ends a job instead of requeueing it,
and what the run cost.

run.yaml has one entry per attempt (`records.write_run_record`); global rank 0 adds to it here:

    started_s     when the attempt's job began (seconds since the epoch)
    devices       {kind: GPU | CPU core, per_process: N}: what one process holds, for the cost
    trained_from  {at, step}: when training started in this attempt, and from which step
    saved         {at, step, path, seconds}: the last checkpoint it wrote, and how long that took
    seen          {at, step}: its last sign of life, at most HEARTBEAT_S old (an attempt killed
                  without a word ended about there)
    ended         {at, how, step, checkpoint}: how it ended (requeued, completed, stopped, failed, ...)
                  and the checkpoint it saved as it ended (the requeue checkpoint), if any

The budgets (docs/guides/slurm.md, "Budgets"): on the requeue signal under SLURM, the job stops instead of
requeueing when `requeue.max_attempts` is reached, or when this attempt got no further than the one
before it (signalled at the step that one was requeued at: what runs before the first step or after
training outlasts the time limit, and every further attempt would do the same). Either ends the job
with one sentence, in the log and in outcome.yaml (`status: stopped`).

The cost (outcome.yaml `cost`, summed by sweep summaries): per attempt and in total, the wall hours,
the device-hours (GPU-hours, or CPU-core-hours on CPUs: processes x devices per process x wall hours)
and the work a later attempt had to do again: the time from the last checkpoint an attempt saved to its
end, when it ended without saving one (killed, or stopped during the test); an attempt requeued on the
signal saves where it stops and redoes nothing.

No torch import: the rules and the arithmetic are functions of the recorded attempts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpctrain.runtime.config.settings import Requeue
from hpctrain.runtime.distributed.endings import Stopped, ending
from hpctrain.runtime.environment import launched
from hpctrain.runtime.storage import records

log = logging.getLogger("hpctrain")

HEARTBEAT_S = 60.0  # how often rank 0 records a sign of life in run.yaml: how late a killed attempt's end is
GPU, CPU_CORE = "GPU", "CPU core"
UNITS = {GPU: "GPU-hours", CPU_CORE: "CPU-core-hours"}


@dataclass
class Attempt:
    """This process's attempt, while `recorded` is open: what rank 0 writes of it in run.yaml."""

    run_dir: Path
    started: float
    registered: bool = False  # rank 0 wrote this attempt's entry in run.yaml
    step: int | None = None  # the training step when it ended
    checkpoint: str | None = None  # saved as it ended (on a signal)

    def begin(self, devices: dict[str, Any]) -> None:
        """Rank 0, once run.yaml has this attempt's entry: when it began and what each process holds."""
        self.registered = True
        update(self.run_dir, started_s=round(self.started, 3), devices=devices)

    def record(self, **fields: Any) -> None:
        """Set `fields` in this attempt's run.yaml entry (rank 0, once `begin` registered it)."""
        if self.registered:
            with suppress(OSError, yaml.YAMLError):
                update(self.run_dir, **fields)

    def note_end(self, step: int | None, checkpoint: str | Path | None) -> None:
        """Where this attempt is as it ends (the training step, the checkpoint it saved then, if any)."""
        self.step = step
        if checkpoint is not None:
            self.checkpoint = str(checkpoint)

    def record_requeue(self, step: int, checkpoint: str | Path | None) -> None:
        """Before asking SLURM to requeue (rank 0): SLURM ends this attempt's processes without a word."""
        ended: dict[str, Any] = {"at": round(time.time(), 3), "how": "requeued", "step": step}
        if checkpoint is not None:
            ended["checkpoint"] = str(checkpoint)
        self.record(ended=ended)


@contextmanager
def recorded(run_dir: str | Path, outcome: records.Outcome) -> Iterator[Attempt]:
    """Around a job, inside `records.outcome_recorded`: at its end, rank 0 records in run.yaml how this
    attempt ended, and puts the run's cost (every attempt so far) into the outcome."""
    attempt = Attempt(Path(run_dir), time.time())
    err: BaseException | None = None
    try:
        yield attempt
    except BaseException as raised:
        err = raised
        raise
    finally:
        if attempt.registered:
            with suppress(OSError, yaml.YAMLError):  # an unwritable run dir has already been reported
                ended = {"at": round(time.time(), 3), "how": ending(err).status, "step": attempt.step}
                if attempt.checkpoint:
                    ended["checkpoint"] = attempt.checkpoint
                record = update(attempt.run_dir, ended=ended)
                outcome.cost = cost(record.get("attempts") or [], time.time())


def devices_of(accelerator: str, cpus_per_process: int) -> dict[str, Any]:
    """What one process holds: one GPU (any accelerator but the CPU), or its CPU cores."""
    if "cpu" in accelerator.lower():
        return {"kind": CPU_CORE, "per_process": cpus_per_process}
    return {"kind": GPU, "per_process": 1}


def update(run_dir: str | Path, **fields: Any) -> dict[str, Any]:
    """Set `fields` in run.yaml's newest attempt (this one's: a run dir runs one job at a time). Rank 0."""
    record = records.read_run_record(run_dir)
    if record.get("attempts"):
        record["attempts"][-1].update(fields)
        records.write_atomically(Path(run_dir) / "run.yaml", yaml.safe_dump(record, sort_keys=False))
    return record


# ------------------------------------------------------------------------------------------ budgets


def previous_requeue_step(attempts: list[dict[str, Any]], run_id: str, restart: int) -> int | None:
    """The step at which the attempt before this one (SLURM restart `restart` - 1 of the job `run_id`)
    was requeued, or None (this is the first attempt, or the one before ended another way)."""
    for entry in attempts:
        if entry.get("run_id") == run_id and entry.get("slurm_restart_count") == restart - 1:
            ended = entry.get("ended") or {}
            if ended.get("how") == "requeued" and ended.get("step") is not None:
                return int(ended["step"])
    return None


class MaxAttemptsReached(Stopped):
    def __init__(self, max_attempts: int, attempt: int, checkpoint: str | Path | None) -> None:
        where, resubmit = _last_checkpoint(checkpoint)
        super().__init__(
            f"requeue.max_attempts={max_attempts} reached: attempt {attempt} would requeue again; {where}; "
            f"raise requeue.max_attempts (null: no cap), or {resubmit}."
        )


class NoProgress(Stopped):
    def __init__(self, attempt: int, step: int, checkpoint: str | Path | None) -> None:
        where, resubmit = _last_checkpoint(checkpoint)
        super().__init__(
            f"attempt {attempt} made no training progress: it was signalled at step {step}, where attempt "
            f"{attempt - 1} was requeued, so every further attempt would end the same way (what runs before "
            f"the first step or after training takes longer than the time limit); {where}; give the job "
            f"more time (sbatch --time), or {resubmit}."
        )


def _last_checkpoint(checkpoint: str | Path | None) -> tuple[str, str]:
    if checkpoint is None:
        return "no checkpoint was saved", "resubmit"
    return f"the last checkpoint is {checkpoint}", f"resubmit with ckpt_path={checkpoint}"


def budget_spent(
    attempt: int,
    step: int,
    previous_step: int | None,
    max_attempts: int | None,
    checkpoint: str | Path | None,
) -> Stopped | None:
    """What ends a job instead of requeueing attempt `attempt` (1 for the first), signalled at training
    step `step`, or None when it may requeue."""
    if previous_step is not None and step <= previous_step:
        return NoProgress(attempt, step, checkpoint)
    if max_attempts is not None and attempt >= max_attempts:
        return MaxAttemptsReached(max_attempts, attempt, checkpoint)
    return None


def stop_if_budget_spent(
    requeue: Requeue, attempt: Attempt, step: int, checkpoint: str | Path | None
) -> None:
    """On every rank, before a requeue: raise the budget's `Stopped` (its sentence) when one is spent.
    Every rank decides alike: from SLURM's restart count, the config, the step and run.yaml's earlier
    attempts (on the run dir every rank shares)."""
    restart = launched.restart_count()
    max_attempts = requeue.max_attempts
    attempts = records.read_run_record(attempt.run_dir).get("attempts") or []
    previous = previous_requeue_step(attempts, launched.run_id(), restart)
    spent = budget_spent(restart + 1, step, previous, max_attempts, checkpoint)
    if spent is None:
        return
    attempt.note_end(step, checkpoint)
    if launched.is_rank_zero():
        log.error("%s", spent)
    raise spent


# ------------------------------------------------------------------------------------------ signal lead


def slow_save_warning(
    save_s: float, step_s: float, steps_between_checks: int, lead_s: float, signal_name: str
) -> str | None:
    """The warning when the slowest checkpoint save plus the wait for the next signal check (one check
    interval: `steps_between_checks` steps of `step_s`) does not fit in the `lead_s` seconds that the
    requeue signal comes before the time limit, else None."""
    wait_s = steps_between_checks * step_s
    needed = save_s + wait_s
    if needed <= lead_s:
        return None
    suggested = max(10, math.ceil(2 * needed / 10) * 10)
    steps = f"{steps_between_checks} training step{'s' if steps_between_checks != 1 else ''}"
    return (
        f"a checkpoint save took {save_s:.2f} s and a signal waits up to {wait_s:.2f} s for the next check "
        f"({steps}): {needed:.2f} s, more than the {lead_s:g} s that {signal_name} comes before the time limit "
        f"(requeue.signal_lead_s={lead_s:g}), so the checkpoint at the time limit may be cut off; raise "
        f"--signal={signal_name}@N in the sbatch file and requeue.signal_lead_s=N together (N={suggested} "
        "or more), or save less (a smaller checkpoint, a faster filesystem for paths.log_dir)."
    )


# ------------------------------------------------------------------------------------------ cost


def _started(entry: dict[str, Any]) -> float | None:
    if entry.get("started_s") is not None:
        return float(entry["started_s"])
    with suppress(TypeError, ValueError, OverflowError):
        return time.mktime(time.strptime(str(entry.get("started")), "%Y-%m-%d %H:%M:%S"))
    return None


def _at(entry: dict[str, Any], key: str) -> float | None:
    value = (entry.get(key) or {}).get("at")
    return float(value) if value is not None else None


def cost(attempts: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    """outcome.yaml's `cost` from run.yaml's attempts: per attempt and in total, wall hours,
    device-hours (processes x devices per process x wall hours) and the hours, and device-hours, of
    work a later attempt did again. An attempt that recorded no end was killed: it counts until its
    last sign of life (`seen`, at most HEARTBEAT_S before it died); the newest one, until `now`."""
    rows = []
    kinds = set()
    for index, entry in enumerate(attempts):
        start = _started(entry)
        if start is None:
            continue
        last = index == len(attempts) - 1
        ended = entry.get("ended") or {}
        seen = [t for t in (_at(entry, "seen"), _at(entry, "saved"), _at(entry, "trained_from")) if t]
        end = _at(entry, "ended") or (now if last else max([start, *seen]))
        how = ended.get("how") or ("running" if last else "killed")
        devices = entry.get("devices") or {"kind": CPU_CORE, "per_process": 1}
        kinds.add(devices.get("kind", CPU_CORE))
        held = int(entry.get("world_size") or 1) * int(devices.get("per_process") or 1)
        wall = max(0.0, end - start) / 3600
        # Work done again: from the last checkpoint to the end of an attempt that a later one followed,
        # unless it saved one as it ended (the requeue checkpoint) or completed.
        redone = 0.0
        if not last and not ended.get("checkpoint") and how != "completed":
            anchors = [t for t in (_at(entry, "saved"), _at(entry, "trained_from")) if t]
            redone = max(0.0, end - max(anchors)) / 3600 if anchors else 0.0
        rows.append(
            {
                "attempt": index + 1,
                "ended": how,
                "processes": int(entry.get("world_size") or 1),
                "per_process": int(devices.get("per_process") or 1),
                "wall_hours": round(wall, 6),
                "device_hours": round(wall * held, 6),
                "redone_hours": round(redone, 6),
                "redone_device_hours": round(redone * held, 6),
            }
        )
    if not rows:
        return None
    unit = UNITS.get(next(iter(kinds)), "device-hours") if len(kinds) == 1 else "device-hours (mixed)"
    summed = ("wall_hours", "device_hours", "redone_hours", "redone_device_hours")
    total = {"attempts": len(rows), **{key: round(sum(row[key] for row in rows), 6) for key in summed}}
    return {"unit": unit, "attempts": rows, "total": total}


# What sweep summaries show of each run's cost (summary.csv) and add up per group (summary_groups.csv).
COST_COLUMNS = ("attempts", "wall_hours", "device_hours", "redone_device_hours", "cost_unit")
_SUMMED = COST_COLUMNS[:-1]


def cost_cells(run_cost: dict[str, Any] | None) -> dict[str, Any]:
    """A run's cost (outcome.yaml `cost`) as summary cells: empty for a run that recorded none."""
    total = run_cost.get("total") if isinstance(run_cost, dict) else None
    if not isinstance(total, dict):
        return dict.fromkeys(COST_COLUMNS, "")
    cells = {key: _number_or_blank(total.get(key)) for key in _SUMMED}
    unit = run_cost.get("unit", "")  # type: ignore[union-attr]
    return {**cells, "cost_unit": str(unit) if unit else ""}


def _number_or_blank(value: Any) -> Any:
    """A number recorded in outcome.yaml (a file a sweep dir holds: perhaps someone else's), else ""."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else ""


def summed_cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cost cells of several runs added up (those that recorded a cost); their unit if they share one."""
    costed = [row for row in rows if row.get("cost_unit")]
    if not costed:
        return dict.fromkeys(COST_COLUMNS, "")
    units = {row["cost_unit"] for row in costed}
    summed = {key: round(sum(float(row[key] or 0) for row in costed), 6) for key in _SUMMED}
    summed["attempts"] = int(summed["attempts"])
    return {**summed, "cost_unit": units.pop() if len(units) == 1 else "device-hours (mixed)"}
