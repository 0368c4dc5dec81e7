"""When a rank fails: deciding which rank failed first, saying so in one line, and ending this one.

A rank whose code raises records one line, `rank R on HOST failed: ...`, in the job's store before it
exits (`note_failure`), so every other rank can name it; a collective that timed out names the ranks
that did not arrive, with where their stacks say they were. Rank 0 of hpctrain's local launcher also
watches the processes it started (`watch_children`: a child killed by SIGKILL or the OOM killer records
nothing), and each child dies with its parent (`die_with_parent`). In a sweep, a failure ends the job,
not the process (`in_sweep`, `take_verdict`).
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
from dataclasses import dataclass, field
from typing import Any

from hpctrain.runtime import run_state
from hpctrain.runtime.distributed import flight_recorder, notify, signals, stacks
from hpctrain.runtime.distributed.endings import ending
from hpctrain.runtime.distributed.job_store import DUMP_KEY, FAILED_KEY, POSITION_KEY, POSTED_KEY, rank, store

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # a terminal colour or style code
PARENT_DIED = "error: rank 0 (the process that started rank {rank}) has died; ending rank {rank} too."
STORE_LOST = "rank 0's process, which serves the job's store, stopped answering (it has died)"


@dataclass
class Failures:
    """How one run fails (`hpctrain.runtime.run_state`): a verdict, the local ranks it watches."""

    in_sweep: bool = False  # this run is a job of a sweep run in this process, one job after another
    stopping: bool = False  # the run is ending (on purpose, or after a failure): exits are not failures
    verdict: str | None = None  # the failure line of this job, once decided
    explained: bool = False  # the verdict says it all: no traceback (a collective that timed out)
    timeout_min: float | None = None  # the collective timeout in force, for the sentence about a hang
    timeout_key: str = "dist.timeout_min"  # ... and the key that sets it (dist.init_timeout_min until a step)
    children: list[Any] = field(default_factory=list)  # the local launcher's processes of ranks 1..N-1


def state() -> Failures:
    """The current run's (a sweep reads a failed job's verdict after its run ended: still that run's)."""
    return run_state.part(Failures)


class RankFailed(RuntimeError):
    """In a sweep, a job's rank failed: the sweep process records it and goes on to the next job."""


def in_sweep() -> None:
    """This run is a job of a sweep that this process runs, one job after another: a failure ends the job,
    not the process (`hpctrain.runtime.run.job.Job` says so as each job begins)."""
    state().in_sweep = True


def pending_verdict() -> str | None:
    """The failure line recorded for a sweep's job, left for `take_verdict` (a rank died: the job failed)."""
    return state().verdict


def take_verdict() -> str | None:
    """The failure line the watchdog recorded before interrupting a sweep's job, if it did."""
    failed = state()
    verdict, failed.verdict = failed.verdict, None
    return verdict


def exit_with(line: str, code: int = 1) -> None:
    """Say `line` and end this rank at once (in a sweep: end the job and let the sweep go on)."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    failed = state()
    if failed.in_sweep:
        if threading.current_thread() is threading.main_thread():
            raise RankFailed(line.removeprefix("error: "))
        if failed.verdict is None:
            failed.verdict = line.removeprefix("error: ")
        _thread.interrupt_main()  # the main thread raises KeyboardInterrupt at its next bytecode
        return
    notify.wait()  # a message this rank posted (its failure), bounded by notify.timeout_s
    logging.shutdown()
    os._exit(code)


def die_with_parent() -> None:
    """In a local child rank: end this process, with a sentence, when its parent (rank 0) dies, however
    it dies (Linux: the kernel sends SIGHUP); if the parent is already gone, end now."""

    def parent_died(signum: int, frame: Any) -> None:
        exit_with(PARENT_DIED.format(rank=rank()))

    signal.signal(signal.SIGHUP, parent_died)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGHUP)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the watchdog still notices rank 0's store going away
    if os.getppid() == 1:  # already re-parented: the parent died before the call above
        parent_died(signal.SIGHUP, None)


def watch_children(procs: list[Any]) -> None:
    """Rank 0 of the local launcher: the child processes (local ranks 1..N-1) to watch."""
    state().children = procs
    signals.local_ranks(procs)  # a stop that nothing answers ends them too


def dead_child() -> str | None:
    for local_rank, proc in enumerate(state().children, start=1):
        code = proc.poll()
        if code is None or code == 0:
            continue
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return f"rank {local_rank} (pid {proc.pid}) {how}"
    return None


def first_failure(wait_s: float = 0.0) -> str | None:
    """Another rank's recorded failure (or a dead child of the local launcher, or a dead rank 0), if any,
    waiting up to `wait_s` for one to show."""
    job = store()
    deadline = time.monotonic() + wait_s
    while True:
        if job is not None:  # a recorded failure says more than an exit status
            try:
                if job.check([FAILED_KEY]):
                    return job.get(FAILED_KEY).decode(errors="replace")
            except Exception:
                return STORE_LOST
        dead = dead_child()
        if dead:
            return dead
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def announce(job: Any | None, line: str, event: str = notify.FAILED) -> None:
    """Record `line` as the job's failure, unless another rank recorded one first; the rank that records it
    posts it (`notify`: failed, or hung), so a job posts one failure (a single process, its own)."""
    if job is not None:
        me = str(rank())
        try:
            if job.compare_set(FAILED_KEY, "", line) != line.encode():
                return  # another rank's failure came first
            # ranks that judge a hang alike record the same line: the first of them posts it
            if job.compare_set(POSTED_KEY, "", me) != me.encode():
                return
        except Exception:
            return
    notify.post(event, line)


def expected(err: BaseException) -> bool:
    """Ways a run ends on purpose (hpctrain.runtime.distributed.endings): not a rank's failure."""
    return ending(err).on_purpose


def note_failure(err: BaseException) -> None:
    """Called while the process group is still up (Lightning's on_exception): decide who failed first,
    and record this rank's failure for the others if it was this one."""
    failed = state()
    failed.stopping = True
    if expected(err) or failed.verdict is not None:
        return
    other = first_failure(wait_s=2.0)
    # one line, without the terminal colour codes some libraries put in their messages (torch.load's)
    summary = " ".join(_ANSI.sub("", f"{type(err).__name__}: {err}").split())
    if other:
        failed.verdict = (
            f"{other}; rank {rank()} on {socket.gethostname()} stopped too ({shorten(summary, 80)})."
        )
        return
    job = store()
    if job is not None and _timed_out(summary):
        line = _who_did_not_arrive(job)
        if line:
            announce(job, line, notify.HUNG)
            failed.verdict, failed.explained = f"{line}.", True  # no traceback of the timed-out collective
            return
    hint = failure_hint(summary)
    who = f"rank {rank()} on {socket.gethostname()} failed: " if job is not None else ""
    line = f"{who}{shorten(summary, 300)}" + (f"; {hint}" if hint else "")
    announce(job, line)
    failed.verdict = f"{line} (traceback above)."


def _timed_out(summary: str) -> bool:
    """A collective that waited past the process group's timeout (gloo and NCCL say it in these words)."""
    lowered = summary.lower()
    return "timed out" in lowered or (
        "timeout" in lowered and ("collective" in lowered or "watchdog" in lowered)
    )


def declare_hang(stalled_s: float) -> None:
    """From the watchdog thread, when no batch has completed on this rank for most of the collective
    timeout: say which rank the job waits for, and end, before NCCL's own watchdog tears the process
    down at the timeout (it leaves no stacks and no sentence, and every rank then blames rank 0, whose
    process served the store). Every rank that finds the job stalled gets here; the first verdict wins."""
    job = store()
    if job is None or state().stopping:
        return
    timeout = state().timeout_min
    within = f"{state().timeout_key}={timeout:g}" if timeout else "the collective timeout"
    reason = f"no batch completed on rank {rank()} for {stalled_s:.0f} s, most of {within}"
    line = _who_did_not_arrive(job, reason=reason) or _where_every_rank_stands(job, reason)
    announce(job, line, notify.HUNG)
    exit_with(f"error: {_recorded(job) or line}.")


def _recorded(job: Any) -> str | None:
    try:
        return job.get(FAILED_KEY).decode(errors="replace") if job.check([FAILED_KEY]) else None
    except Exception:
        return None


def _where_every_rank_stands(job: Any, reason: str) -> str:
    """The sentence when no rank lags by position: where each one's stacks say it is."""
    run_dir = stacks.run_dir()
    places = stacks.places(run_dir) if run_dir is not None else {}
    where = f" ({stacks.summary(places)})" if places else ""
    return f"the job hung: {reason}{where}{stacks.folder_note(run_dir)}"


def _who_did_not_arrive(job: Any, wait_s: float = 3.0, reason: str | None = None) -> str | None:
    """After a collective timed out on this rank (or the job stalled, `declare_hang`): every rank dumps
    its stacks (DUMP_KEY), and the ranks whose last recorded position lags the others' are named, with
    where their stacks say they were; a rank that published no position (it has not reached the run's
    setup) is named as such. A key is read only once it exists: a get of a missing key would wait for the
    store's whole timeout."""
    me = rank()
    reason = reason or f"a collective timed out on rank {me}"
    try:
        job.compare_set(DUMP_KEY, "", reason)
    except Exception:
        return None
    stacks.dump(reason)
    flight_recorder.dump()  # the collectives in flight: torch writes its own only at NCCL's timeout
    time.sleep(wait_s)  # the other ranks' watchdogs look every second
    import torch.distributed as dist

    positions: dict[int, tuple[int, int, str, int, int, str]] = {}
    for other in range(dist.get_world_size()):
        key = f"{POSITION_KEY}/{other}"
        try:
            if job.check([key]):
                done, phase, stage, epoch, step, host = job.get(key).decode().split(" ", 5)
                positions[other] = (int(done), int(phase), stage, int(epoch), int(step), host)
        except Exception:
            continue
    if not positions:
        return None
    furthest = max(positions.values())
    lagging = [r for r in range(dist.get_world_size()) if positions.get(r, (-1,))[:2] < furthest[:2]]
    if not lagging:
        return None
    run_dir = stacks.run_dir()
    stood = stacks.places(run_dir) if run_dir is not None else {}
    places = []
    for late in lagging:
        if late in positions:
            done, host = positions[late][0], positions[late][5]
            behind = (
                "before its backward pass"
                if done == furthest[0]
                else f"{furthest[0] - done} batch(es) behind"
            )
            place = f"rank {late} on {host} ({behind}"
        else:
            place = f"rank {late} (no position: it has not reached the run's setup"
        places.append(place + (f", {stood[late]})" if late in stood else ")"))
    failed = state()
    within = f" within {failed.timeout_key}={failed.timeout_min:g}" if failed.timeout_min else ""
    return (
        f"{'; '.join(places)} did not arrive at a collective{within} while the others waited for "
        f"{'it' if len(lagging) == 1 else 'them'} {_where(*furthest[2:5])}{stacks.folder_note(run_dir)}"
    )


LOOPS = {
    "sanity_check": "the sanity check",
    "validate": "validation",
    "test": "the test",
    "predict": "prediction",
}


def _where(stage: str, epoch: int, step: int) -> str:
    """Where a rank stands, in words: `at step 3 of epoch 0`, `in validation at step 3 of epoch 0`."""
    loop = f"in {LOOPS[stage]} " if stage in LOOPS else "setting up, " if stage == "setup" else ""
    return f"{loop}at step {step} of epoch {epoch}"


def set_timeout_min(minutes: float, key: str = "dist.timeout_min") -> None:
    """The collective timeout now in force, and the key that sets it (for the sentences)."""
    state().timeout_min, state().timeout_key = float(minutes), key


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
