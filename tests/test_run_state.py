"""State lives on objects that begin and end with the run (`hpctrain.runtime.run_state`): the jobs of a sweep
(-m) that Hydra's basic launcher runs in turn in one process find nothing the previous job left.

The sweep runs in this process, through Hydra's own multirun and hpctrain's `run_job` and `job`, without
torch: the task leaves each kind of state the real code would (through the functions that set it), and
its first job then dies as a rank's failure does in a sweep (a verdict recorded from another thread,
the main thread interrupted), so the sweep must read that verdict after the job's end.
"""

from __future__ import annotations

import faulthandler
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hydra
import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from hpctrain.runtime import run_state
from hpctrain.runtime.distributed import failures, job_store, notify, positions, signals, stacks, watchdog
from hpctrain.runtime.run import entry
from hpctrain.runtime.run.job import Skipped
from tests.helpers import ROOT


def what_a_job_finds(job: Any) -> dict[str, Any]:
    """Every kind of state a job could inherit, as the job sees it once its preflight has run."""
    return {
        "signal": signals.received(),
        "progress": signals.progress(),
        "verdict": failures.pending_verdict(),
        "children": list(failures.state().children),
        "timeout_min": failures.state().timeout_min,
        "notify ended": run_state.part(notify.Notifier).ended,
        "followed": (positions._followed().trainer, positions._followed().report),
        "stacks": stacks.run_dir(),
        "finished worker": run_state.part(watchdog.Watching).finished_worker,
        "data parallel": job_store.data_parallel(),
        "attempt": job.attempt.run_dir,
        "in sweep": failures.state().in_sweep,
    }


FRESH = {
    "signal": signals.NO_SIGNAL,
    "progress": (0, False),
    "verdict": None,
    "children": [],
    "timeout_min": None,
    "notify ended": False,
    "followed": (None, None),
    "stacks": None,
    "finished worker": False,
    "data parallel": None,
    "in sweep": True,
}


def leave_everything(run_dir: Path) -> None:
    """What a job leaves when it ends part-way: a signal recorded, a batch counted, local ranks watched,
    an ending posted, a trainer followed, faulthandler registered, a data-parallel group, a finished rank."""
    # recorded: requeue.enabled=true installs the recording handler (the requeue signal: a SIGTERM here and
    # the interrupt below would be two stop signals, which the stop guard answers by ending the process)
    signal.raise_signal(signal.SIGUSR1)
    signals.arm()
    signals.progressed(0.5)
    signals.arm(False)  # so that the interrupt below is Python's KeyboardInterrupt, as outside the loops
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    failures.watch_children([child])
    failures.set_timeout_min(7)
    notify.post(notify.HUNG, "rank 1 hung")  # no webhook set: nothing sent, but the ending is taken
    positions.follow(object())
    positions.watch_steps(None, object())
    stacks.register(run_dir, "SIGURG")
    job_store.set_data_parallel(2, 1)
    watchdog.finished_worker()


def die_as_a_rank_of_a_sweep_job() -> None:
    """A rank's failure seen by the watchdog thread: the verdict recorded, the main thread interrupted."""
    thread = threading.Thread(target=failures.exit_with, args=("error: rank 1 on node7 failed: boom",))
    thread.start()
    thread.join()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # KeyboardInterrupt arrives at the next bytecode
        time.sleep(0.01)
    raise AssertionError("the main thread was not interrupted")


@pytest.mark.slow  # runs two jobs of a sweep (the quick tier starts no run)
def test_the_jobs_of_a_sweep_in_one_process_find_no_state_of_the_previous_one(tmp_path: Path, monkeypatch):
    found: dict[int, dict[str, Any]] = {}
    left: list[Any] = []

    def task(cfg: Any) -> Any:
        from hpctrain.runtime.run.job import job

        number = HydraConfig.get().job.num
        with job(cfg) as current:
            found[number] = what_a_job_finds(current)
            left.append(signals._state().guard)  # each job's stop guard: stopped as its job ends
            if number == 0:
                leave_everything(current.run_dir)
                die_as_a_rank_of_a_sweep_job()
        return current.outcome

    @hydra.main(config_path=str(ROOT / "conf"), config_name="train", **entry.main_args())
    def main(cfg: Any) -> Any:
        from hpctrain.runtime.run.job import run_job

        return run_job(task, cfg)

    sweep = tmp_path / "sweep"
    argv = [
        "train.py",
        "-m",
        "seed=1,2",
        "trainer=cpu",
        f"hydra.sweep.dir={sweep}",
        f"paths.output_dir={tmp_path}",
        f"paths.log_dir={tmp_path}",
        f"paths.data_dir={tmp_path / 'data'}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    GlobalHydra.instance().clear()
    try:
        main()
    finally:
        GlobalHydra.instance().clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    assert sorted(found) == [0, 1]
    assert found[0]["attempt"] == sweep / "0" and found[1]["attempt"] == sweep / "1"  # each its own attempt
    for number in (0, 1):
        seen = {k: v for k, v in found[number].items() if k != "attempt"}
        assert seen == FRESH, (number, seen)
    # what ran is stopped as the job ends: faulthandler no longer dumps into job 0's folder, its guard ended
    assert not faulthandler.unregister(signal.SIGURG)
    assert not any(thread.is_alive() for thread in left)
    # the sweep read job 0's verdict after the job ended (the sweep went on), and recorded it
    outcome = yaml.safe_load((sweep / "0" / "outcome.yaml").read_text())
    assert outcome["status"] == "failed" and "rank 1 on node7 failed: boom" in str(outcome), outcome
    # the sweep's own state ended with it
    assert run_state.sweep_part(Skipped).jobs == []


@pytest.fixture(autouse=True)
def _ended_run():
    """Whatever this test's jobs left ends here, as the next job's start would end it."""
    yield
    run_state.begin()
    run_state.end()
