"""When one rank dies, the whole job ends within seconds, naming that rank.

DDP ranks wait for each other in every collective. A rank that raises, is OOM-killed or SIGKILLed
leaves the others waiting: gloo notices a closed connection at once, but names no rank, and NCCL
may wait out its whole collective timeout (30 minutes by default). Three mechanisms close that gap:

- A rank whose code raises prints its traceback and one line, `error: rank R on HOST failed: ...`,
  and records that line in the job's key-value store (the TCPStore every process group has, served
  by rank 0's process) before it exits (`report_failure`).
- Every rank runs a `Watchdog` thread once its process group exists: every second it looks for that
  record (one small request to the store) and, when it finds one, prints who failed and exits. If
  the store itself stops answering (rank 0's process is gone), it exits too, saying so.
- Under the template's own local launcher, rank 0 also watches the processes it started (a child
  killed by SIGKILL or the OOM killer never records anything), and each child dies with its parent.

Under SLURM, srun's `--kill-on-bad-exit=1` (slurm/train.sbatch) ends every task as soon as one exits
badly and names the task; under torchrun, its agent does the same. The watchdog adds the sentence
and covers the local launcher, where nothing else would.
"""

from __future__ import annotations

import _thread
import ctypes
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from hpctrain.runtime.distributed import stacks, stragglers

log = logging.getLogger(__package__)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # a terminal colour or style code

FAILED_KEY = f"{__package__}/failed-rank"
DATA_END_KEY = f"{__package__}/data-end"  # + /<epoch>: the first rank whose training data ran out, and when
POSITION_KEY = (
    f"{__package__}/position"  # + /<rank>: "<epoch> <batch> <host>", written by its watchdog each second
)
DUMP_KEY = f"{__package__}/dump-stacks"  # set: every rank's watchdog appends its stacks to its file, once
PARENT_DIED = "error: rank 0 (the process that started rank {rank}) has died; ending rank {rank} too."
STORE_LOST = "rank 0's process, which serves the job's store, stopped answering (it has died)"
POLL_S = 1.0
LOST_AFTER = 3  # consecutive failed polls of the store before concluding rank 0's process is gone

_state: dict[str, Any] = {
    "watchdog": None,  # the running Watchdog thread
    "children": [],  # rank 0 of the local launcher: the processes of local ranks 1..N-1
    "stopping": False,  # the run is ending on purpose: exits are no longer failures
    "finished_worker": False,  # a rank > 0 whose run completed (exit_if_finished_worker)
    "trainer": None,  # the Trainer being watched, for where this rank is in its training epoch
    "in_sweep": False,  # this process runs a sweep's jobs one after another
    "timeout_min": None,  # dist.timeout_min, for the sentence about a collective that timed out
    # "verdict": the failure line recorded for a sweep's job (present only after a failure)
}


def _rank() -> int:
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    from hpctrain.runtime import cluster

    return cluster.global_rank()


def _store() -> Any | None:
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a process group without a store (not the case for env:// or TCP init)
        return None


class RankFailed(RuntimeError):
    """In a sweep, a job's rank failed: the sweep process records it and goes on to the next job."""


def in_sweep() -> None:
    """This process runs a sweep's jobs one after another: a failure ends the job, not the process."""
    _state["in_sweep"] = True


def pending_verdict() -> str | None:
    """The failure line recorded for a sweep's job, left for `take_verdict` (a rank died: the job failed)."""
    return _state.get("verdict")


def take_verdict() -> str | None:
    """The failure line the watchdog recorded before interrupting a sweep's job, if it did."""
    return _state.pop("verdict", None)


def _exit(line: str, code: int = 1) -> None:
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _state.get("in_sweep"):
        if threading.current_thread() is threading.main_thread():
            raise RankFailed(line.removeprefix("error: "))
        _state.setdefault("verdict", line.removeprefix("error: "))
        _thread.interrupt_main()  # the main thread raises KeyboardInterrupt at its next bytecode
        return
    logging.shutdown()
    os._exit(code)


def die_with_parent() -> None:
    """In a local child rank: end this process, with a sentence, when its parent (rank 0) dies, however
    it dies (Linux: the kernel sends SIGHUP); if the parent is already gone, end now."""

    def parent_died(signum: int, frame: Any) -> None:
        _exit(PARENT_DIED.format(rank=_rank()))

    signal.signal(signal.SIGHUP, parent_died)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGHUP)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the watchdog still notices rank 0's store going away
    if os.getppid() == 1:  # already re-parented: the parent died before the call above
        parent_died(signal.SIGHUP, None)


def stop() -> None:
    """The job is ending normally (or requeueing): stop watching, so an orderly exit is not a failure."""
    _state["stopping"] = True
    watchdog = _state["watchdog"]
    if watchdog is not None:
        watchdog.stop()
        # Wait for it to leave its store request: a thread still inside the store's C++ code when the
        # process group is destroyed, or when the interpreter exits, can abort the process.
        if watchdog is not threading.current_thread():
            watchdog.join(timeout=POLL_S + 5)
        _state["watchdog"] = None


def watch_children(procs: list[Any]) -> None:
    """Rank 0 of the local launcher: the child processes (local ranks 1..N-1) to watch."""
    _state["children"] = procs


def _dead_child() -> str | None:
    for local_rank, proc in enumerate(_state["children"], start=1):
        code = proc.poll()
        if code is None or code == 0:
            continue
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return f"rank {local_rank} (pid {proc.pid}) {how}"
    return None


def first_failure(wait_s: float = 0.0) -> str | None:
    """Another rank's recorded failure (or a dead child of the local launcher, or a dead rank 0), if any,
    waiting up to `wait_s` for one to show."""
    store = _store()
    deadline = time.monotonic() + wait_s
    while True:
        if store is not None:  # a recorded failure says more than an exit status
            try:
                if store.check([FAILED_KEY]):
                    return store.get(FAILED_KEY).decode(errors="replace")
            except Exception:
                return STORE_LOST
        dead = _dead_child()
        if dead:
            return dead
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


class Watchdog(threading.Thread):
    def __init__(self, rank: int) -> None:
        super().__init__(name="rank-watchdog", daemon=True)
        self.rank = rank
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        store = _store()
        misses = 0
        dumped = False
        while not self._stopped.wait(POLL_S):
            dead = _dead_child()
            if dead and not _state["stopping"]:
                _announce(store, f"{dead}")
                _exit(f"error: {dead} on {socket.gethostname()}; ending the job.")
            if store is None:
                continue
            try:
                _note_position(store, self.rank)
                _publish_timing(store, self.rank)
                if not dumped and store.check([DUMP_KEY]):  # before the failure below ends this process
                    stacks.dump(store.get(DUMP_KEY).decode(errors="replace"))
                    dumped = True
                failed = store.check([FAILED_KEY]) and store.get(FAILED_KEY).decode(errors="replace")
                misses = 0
            except Exception:
                misses += 1
                if misses >= LOST_AFTER and not self._stopped.is_set() and not _state["stopping"]:
                    _exit(f"error: {STORE_LOST}; ending rank {self.rank} on {socket.gethostname()} too.")
                continue
            if failed and not self._stopped.is_set():
                _exit(f"error: {failed}; rank {self.rank} stops too.")
            uneven = _ran_past_another_ranks_data(store, self.rank)
            if uneven and not self._stopped.is_set() and not _state["stopping"]:
                _announce(store, uneven)
                _exit(f"error: {uneven}.")


# ------------------------------------------------------------------------- uneven training data


def _position(trainer: Any) -> tuple[int, int] | None:
    """(epoch, batches this rank has in it so far) while it trains, else None: the batches fetched, plus
    the next one when the loader already holds it (it is not at its last batch). Plain attribute reads:
    safe from the watchdog thread, and nothing is added to the training step."""
    if trainer is None or not trainer.training:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return trainer.current_epoch, progress.current.ready + (0 if progress.is_last_batch else 1)


def _note_position(store: Any, rank: int) -> None:
    """Where this rank is in training, for the sentence about a rank that does not arrive at a collective."""
    trainer = _state["trainer"]
    if trainer is not None and trainer.training:  # plain attribute reads, safe from this thread
        phase = _state.get("phase", 0)
        store.set(
            f"{POSITION_KEY}/{rank}",
            f"{trainer.current_epoch} {trainer.global_step} {phase} {socket.gethostname()}",
        )


def _publish_timing(store: Any, rank: int) -> None:
    """This rank's step clock into the store; on rank 0, now and then, the straggler lines."""
    clock = _state.get("clock")
    if clock is None or not clock.steps:
        return
    store.set(f"{stragglers.TIMING_KEY}/{rank}", clock.record())
    report = _state.get("stragglers")
    if report is not None and report.due():
        for line in report.report(store):
            log.warning(line)


def publish_timing() -> None:
    """This rank's final step clock, from the training thread when training ends (the watchdog's last
    publication may be a second old)."""
    store, clock = _store(), _state.get("clock")
    if store is not None and clock is not None and clock.steps:
        store.set(f"{stragglers.TIMING_KEY}/{_rank()}", clock.record())


def watch_steps(clock: Any, report: Any | None) -> None:
    """Publish `clock` (a stragglers.StepClock) each second; on rank 0, `report` compares the ranks."""
    _state["clock"], _state["stragglers"] = clock, report


def rank_summary() -> dict[int, dict[str, Any]] | None:
    """Rank 0 at the end of a run: each rank's time per step (for outcome.yaml), read from the store."""
    report, store = _state.get("stragglers"), _store()
    if report is None or store is None:
        return None
    report.totals = report.read(store)
    return report.summary() or None


def note_phase(phase: int) -> None:
    """Where this rank is within its training step: 0 before the backward pass (the forward pass, the
    user's training_step), 1 once it began (DDP's gradient all-reduce). A plain assignment per step."""
    _state["phase"] = phase


def _ran_past_another_ranks_data(store: Any, rank: int) -> str | None:
    """The failure line when another rank's training data ran out in this epoch after fewer batches
    than this rank is already training on (its next collective would wait forever)."""
    position = _position(_state["trainer"])
    if position is None:
        return None
    epoch, batches = position
    key = f"{DATA_END_KEY}/{epoch}"
    try:
        if not store.check([key]):
            return None
        other, host, ended_after = store.get(key).decode().split(" ", 2)
    except Exception:
        return None
    if batches <= int(ended_after) or int(other) == rank:
        return None
    return (
        f"rank {other} on {host} ran out of training data after {ended_after} batches of epoch {epoch}, while "
        f"rank {rank} on {socket.gethostname()} had more: the ranks' training loaders yield different numbers "
        "of batches (a stream sharded by hand?), and DDP needs the same number on every rank; share the data "
        "out evenly (hpctrain.data.iterable.ShardedIterable with drop_last=True, or limit_train_batches)"
    )


def follow(trainer: Any) -> None:
    """Watch where `trainer` is in its training epochs (for `note_training_data_end`)."""
    _state["trainer"] = trainer


def note_training_data_end(epoch: int, batches: int, world_size: int, timeout_s: float) -> None:
    """This rank's training data for `epoch` ran out after `batches` batches: record it, then wait until
    every rank has got there too, before validation's collectives begin. A rank with more data gets no
    further than its next batch: its watchdog sees this record and ends the job naming this rank.

    Once per epoch, through the job's store: no collective is added, and ranks in step (the normal case)
    pass at once. After `timeout_s` (a rank merely slow) the run goes on as it would have.
    """
    store = _store()
    if store is None:
        return
    key = f"{DATA_END_KEY}/{epoch}"
    everyone = f"{key}/everyone"  # set by the last rank to arrive
    store.compare_set(key, "", f"{_rank()} {socket.gethostname()} {batches}")
    if store.add(f"{key}/arrived", 1) >= world_size:
        store.set(everyone, "1")
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            store.wait([everyone], timedelta(seconds=POLL_S))  # one request, answered when the key is set
            return
        except Exception:  # not yet: has a rank failed meanwhile (or ran past this one's data)?
            if store.check([FAILED_KEY]):
                _exit(f"error: {store.get(FAILED_KEY).decode(errors='replace')}; rank {_rank()} stops too.")
                return


def start() -> None:
    """Start watching (once the process group exists; a no-op for a single process)."""
    if _state["watchdog"] is not None or _store() is None:
        return
    _state["stopping"] = False
    watchdog = Watchdog(_rank())
    _state["watchdog"] = watchdog
    watchdog.start()


def _announce(store: Any | None, line: str) -> None:
    if store is None:
        return
    try:
        if not store.check([FAILED_KEY]):
            store.set(FAILED_KEY, line)
    except Exception:
        pass


def _expected(err: BaseException) -> bool:
    """Ways a run ends on purpose (hpctrain.runtime.distributed.endings): not a rank's failure."""
    from hpctrain.runtime.distributed.endings import ending

    return ending(err).on_purpose


def note_failure(err: BaseException) -> None:
    """Called while the process group is still up (Lightning's on_exception): decide who failed first,
    and record this rank's failure for the others if it was this one."""
    _state["stopping"] = True
    if _expected(err) or "verdict" in _state:
        return
    other = first_failure(wait_s=2.0)
    # one line, without the terminal colour codes some libraries put in their messages (torch.load's)
    summary = " ".join(_ANSI.sub("", f"{type(err).__name__}: {err}").split())
    if other:
        _state["verdict"] = (
            f"{other}; rank {_rank()} on {socket.gethostname()} stopped too ({shorten(summary, 80)})."
        )
        return
    store = _store()
    if store is not None and _timed_out(summary):
        line = _who_did_not_arrive(store)
        if line:
            _announce(store, line)
            _state["verdict"] = f"{line}."
            _state["explained"] = True  # the sentence says it all: no traceback of the timed-out collective
            return
    hint = failure_hint(summary)
    who = f"rank {_rank()} on {socket.gethostname()} failed: " if store is not None else ""
    line = f"{who}{shorten(summary, 300)}" + (f"; {hint}" if hint else "")
    _announce(store, line)
    _state["verdict"] = f"{line} (traceback above)."


def _timed_out(summary: str) -> bool:
    """A collective that waited past the process group's timeout (gloo and NCCL say it in these words)."""
    lowered = summary.lower()
    return "timed out" in lowered or (
        "timeout" in lowered and ("collective" in lowered or "watchdog" in lowered)
    )


def _who_did_not_arrive(store: Any, wait_s: float = 3.0) -> str | None:
    """After a collective timed out on this rank: every rank dumps its stacks (DUMP_KEY), and the ranks
    whose last recorded position lags the others' are named, with where their stacks say they were."""
    me = _rank()
    reason = f"a collective timed out on rank {me}"
    try:
        store.compare_set(DUMP_KEY, "", reason)
    except Exception:
        return None
    stacks.dump(reason)
    time.sleep(wait_s)  # the other ranks' watchdogs look every second
    import torch.distributed as dist

    positions: dict[int, tuple[int, int, int, str]] = {}
    for rank in range(dist.get_world_size()):
        try:
            epoch, step, phase, host = store.get(f"{POSITION_KEY}/{rank}").decode().split(" ", 3)
            positions[rank] = (int(epoch), int(step), int(phase), host)
        except Exception:
            continue
    if not positions:
        return None
    furthest = max(p[:3] for p in positions.values())
    lagging = sorted(r for r, p in positions.items() if p[:3] < furthest)
    if not lagging:
        return None
    run_dir = stacks.run_dir()
    places = []
    for rank in lagging:
        epoch, step, phase, host = positions[rank]
        behind = (
            "before its backward pass"
            if (epoch, step) == furthest[:2]
            else f"at step {step} of epoch {epoch}"
        )
        place = f"rank {rank} on {host} ({behind}"
        if run_dir is not None:
            frames = stacks.main_thread_frames(stacks.latest_dump(stacks.rank_file(run_dir, rank)))
            if frames:
                place += f", {stacks.where(frames)}"
        places.append(place + ")")
    timeout = _state.get("timeout_min")
    within = f" within dist.timeout_min={timeout:g}" if timeout else ""
    where = f"; every rank's stacks: {run_dir / stacks.STACKS_DIR}/rank<N>.txt" if run_dir is not None else ""
    return (
        f"{'; '.join(places)} did not arrive at a collective{within} while the others waited for "
        f"{'it' if len(lagging) == 1 else 'them'} at step {furthest[1]} of epoch {furthest[0]}{where}"
    )


def set_timeout_min(minutes: float) -> None:
    _state["timeout_min"] = float(minutes)


def shorten(text: str, limit: int) -> str:
    """`text` cut to at most about `limit` characters at a word boundary, never mid-word."""
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return f"{cut} ..."


def failure_hint(summary: str) -> str | None:
    """The config key that fixes a failure torch explains only in its own terms."""
    if "find_unused_parameters" in summary or "were not used in producing" in summary:
        return (
            "some parameters got no gradient in a step (manual optimization, a GAN, a branch not taken): "
            "pass dist.find_unused_parameters=true (or dist.static_graph=true if the graph is the same every step)"
        )
    return None


@contextmanager
def failures_reported() -> Iterator[None]:
    """Around a rank's whole run: an unexpected exception is printed with a line naming the rank that
    failed first (this one, or another whose failure made this one's collective break), recorded for
    the other ranks, and ends the process with status 1 without waiting for anything."""
    try:
        yield
    except BaseException as err:
        if _expected(err):
            stop()
            raise
        note_failure(err)
        if not _state.pop("explained", False):
            traceback.print_exc()
        _exit(f"error: {_state.pop('verdict')}")


def finished_worker() -> None:
    """Called on a rank other than 0 once its run completed and the final barrier passed."""
    _state["finished_worker"] = True


def exit_if_finished_worker() -> None:
    """A rank other than 0 whose run completed leaves with os._exit(0), after flushing its output.

    It has nothing left to write (rank 0 writes every file, and the final barrier has passed), and a
    normal interpreter exit runs C++ destructors that, rarely and only under load, abort a process
    after its process group was destroyed ("terminate called without an active exception", seen on
    gloo with torch 2.14): srun or torchrun would then fail a job that trained fine.
    """
    if _state["finished_worker"]:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
