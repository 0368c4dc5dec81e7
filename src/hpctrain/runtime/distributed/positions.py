"""Where each rank is in its run: the batches it completed, its loop, epoch, step and phase (for the
sentence that names a rank that does not arrive at a collective), its step clock (stragglers), and where
its training data ran out (ranks whose loaders yield different numbers of batches end the job naming the
rank, instead of hanging).

The training thread only assigns (`follow`, `note_phase`, `watch_steps`); the watchdog thread reads and
publishes to the job's store each second (`publish`), so nothing is added to a training step.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpctrain.runtime import run_state
from hpctrain.runtime.distributed import signals, stragglers
from hpctrain.runtime.distributed.failures import exit_with
from hpctrain.runtime.distributed.job_store import DATA_END_KEY, FAILED_KEY, POSITION_KEY, rank, store

log = logging.getLogger(__package__)
POLL_S = 1.0


@dataclass
class Followed:
    """Where this rank is in one run (`hpctrain.runtime.run_state`): dropped with the run, so a trainer or a
    straggler report a job left behind is never the next job's."""

    trainer: Any = None  # the Trainer being watched, for where this rank is in its training epoch
    phase: int = 0  # 0 before the backward pass of the current step, 1 once it began
    clock: stragglers.StepClock | None = None  # this rank's own time per step
    report: stragglers.StragglerReport | None = None  # rank 0: compares the ranks' clocks


def _followed() -> Followed:
    return run_state.part(Followed)


def follow(trainer: Any) -> None:
    """Watch where `trainer` is in its training epochs (for `note_training_data_end`)."""
    _followed().trainer = trainer


def note_phase(phase: int) -> None:
    """Where this rank is within its training step: 0 before the backward pass (the forward pass, the
    user's training_step), 1 once it began (DDP's gradient all-reduce). A plain assignment per step."""
    _followed().phase = phase


def watch_steps(clock: Any, report: Any | None) -> None:
    """Publish `clock` (a stragglers.StepClock) each second; on rank 0, `report` compares the ranks."""
    followed = _followed()
    followed.clock, followed.report = clock, report


def _position(trainer: Any) -> tuple[int, int] | None:
    """(epoch, batches this rank has in it so far) while it trains, else None: the batches fetched, plus
    the next one when the loader already holds it (it is not at its last batch). Plain attribute reads:
    safe from the watchdog thread, and nothing is added to the training step."""
    if trainer is None or not trainer.training:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return trainer.current_epoch, progress.current.ready + (0 if progress.is_last_batch else 1)


def publish(job: Any, me: int) -> None:
    """From the watchdog thread, each second from the run's setup on (the sanity check, training, validation,
    test and predict alike): this rank's position and step clock into the store; on rank 0, now and then,
    the straggler lines. A position is the batches this rank completed so far in every loop (the same
    sequence on every rank), its phase, its loop, epoch and step: plain attribute reads, safe here."""
    followed = _followed()
    trainer = followed.trainer
    if trainer is not None:
        stage = getattr(trainer.state.stage, "value", None) or "setup"
        job.set(
            f"{POSITION_KEY}/{me}",
            f"{signals.progress()[0]} {followed.phase} {stage} {trainer.current_epoch} {trainer.global_step} "
            f"{socket.gethostname()}",
        )
    clock = followed.clock
    if clock is None or not clock.steps:
        return
    job.set(f"{stragglers.TIMING_KEY}/{me}", clock.record())
    report = followed.report
    if report is not None and report.due():
        for line in report.report(job):
            log.warning(line)


def publish_timing() -> None:
    """This rank's final step clock, from the training thread when training ends (the watchdog's last
    publication may be a second old)."""
    job, clock = store(), _followed().clock
    if job is not None and clock is not None and clock.steps:
        job.set(f"{stragglers.TIMING_KEY}/{rank()}", clock.record())


def rank_summary() -> dict[int, dict[str, Any]] | None:
    """Rank 0 at the end of a run: each rank's time per step (for outcome.yaml), read from the store."""
    report, job = _followed().report, store()
    if report is None or job is None:
        return None
    report.totals = report.read(job)
    return report.summary() or None


def ran_past_another_ranks_data(job: Any, me: int) -> str | None:
    """The failure line when another rank's training data ran out in this epoch after fewer batches
    than this rank is already training on (its next collective would wait forever)."""
    position = _position(_followed().trainer)
    if position is None:
        return None
    epoch, batches = position
    key = f"{DATA_END_KEY}/{epoch}"
    try:
        if not job.check([key]):
            return None
        other, host, ended_after = job.get(key).decode().split(" ", 2)
    except Exception:
        return None
    if batches <= int(ended_after) or int(other) == me:
        return None
    return (
        f"rank {other} on {host} ran out of training data after {ended_after} batches of epoch {epoch}, while "
        f"rank {me} on {socket.gethostname()} had more: the ranks' training loaders yield different numbers "
        "of batches (a stream sharded by hand?), and DDP needs the same number on every rank; share the data "
        "out evenly (hpctrain.data.iterable.ShardedIterable with drop_last=True, or limit_train_batches)"
    )


def note_training_data_end(epoch: int, batches: int, world_size: int, timeout_s: float) -> None:
    """This rank's training data for `epoch` ran out after `batches` batches: record it, then wait until
    every rank has got there too, before validation's collectives begin. A rank with more data gets no
    further than its next batch: its watchdog sees this record and ends the job naming this rank.

    Once per epoch, through the job's store: no collective is added, and ranks in step (the normal case)
    pass at once. After `timeout_s` (a rank merely slow) the run goes on as it would have.
    """
    job = store()
    if job is None:
        return
    key = f"{DATA_END_KEY}/{epoch}"
    everyone = f"{key}/everyone"  # set by the last rank to arrive
    job.compare_set(key, "", f"{rank()} {socket.gethostname()} {batches}")
    if job.add(f"{key}/arrived", 1) >= world_size:
        job.set(everyone, "1")
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            job.wait([everyone], timedelta(seconds=POLL_S))  # one request, answered when the key is set
            return
        except Exception:  # not yet: has a rank failed meanwhile (or ran past this one's data)?
            if job.check([FAILED_KEY]):
                exit_with(f"error: {job.get(FAILED_KEY).decode(errors='replace')}; rank {rank()} stops too.")
                return
