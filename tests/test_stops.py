"""A run that hangs still ends: a SIGTERM or a Ctrl-C that no step boundary answers ends every local rank
within seconds, in one sentence that names where each rank stood; a second one ends it at once. And a
callback that runs the model on one rank under FSDP2, which would hang the job, is named within seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpctrain.runtime.distributed import stacks
from tests.differential.cases import user_overrides
from tests.helpers import PYTHON, ROOT, local_env, run_dirs, train

pytestmark = pytest.mark.slow


def _hung_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """Two DDP ranks on CPU whose rank 0 hangs in a callback at the end of the sanity check."""
    mark = tmp_path / "hung"
    env = {**local_env(), "PYTHONPATH": str(ROOT), "HANG_MARK": str(mark)}
    command = [
        PYTHON,
        str(ROOT / "src" / "train.py"),
        f"paths.log_dir={tmp_path}",
        "extras.print_config=false",
        *user_overrides("LitClassifier"),
        "trainer=ddp_cpu",
        "+callbacks.hang._target_=tests.differential.user_code.HangOnRankZero",
        "requeue.stop_grace_s=3",
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300  # the start of two ranks on a loaded machine
    while not mark.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            # The run hangs by design once it gets there: end its session before reading what it printed,
            # or reading would wait for a process that never ends.
            _end_session(process)
            output = process.communicate(timeout=30)[0]
            pytest.fail(f"no rank reached the hang (exit {process.returncode}):\n{output[-3000:]}")
        time.sleep(0.2)
    time.sleep(1.0)  # the other rank is in its next collective by now
    return process, run_dirs(tmp_path)[0]


@pytest.fixture
def hung_run(tmp_path: Path):
    """The hung run; whatever the test asserts, nothing of it outlives the test."""
    process, run = _hung_run(tmp_path)
    try:
        yield process, run
    finally:
        _end_session(process)
        process.communicate(timeout=30)


def _end_session(process: subprocess.Popen) -> None:
    """SIGKILL the run and every rank it started (they share its session, start_new_session=True)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _pids(run: Path) -> list[int]:
    return [pid for pid, _ in stacks.known_ranks(run).values()]


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie that nothing has reaped yet (its parent, rank 0, is gone too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


# SIGTERM (what SLURM and kill send) in CI; SIGINT takes the same path (a second Ctrl-C: the test below)
@pytest.mark.parametrize("sent", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.ondemand)])
def test_a_signal_nothing_answers_ends_every_rank_naming_where_each_stood(sent: int, hung_run):
    process, run = hung_run
    ranks = _pids(run)
    sent_at = time.monotonic()
    process.send_signal(sent)
    output, _ = process.communicate(timeout=60)
    took = time.monotonic() - sent_at
    assert process.returncode == 128 + sent, output[-3000:]
    assert took < 15, f"took {took:.0f} s"
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    name = signal.Signals(sent).name
    assert errors[0].startswith(
        f"error: {name} was not answered within 3 s, and no step boundary came (rank 0: "
    )
    assert "on_sanity_check_end at user_code.py:" in errors[0] and "rank 1: " in errors[0]
    assert f"ending every local rank (exit {128 + sent})" in errors[0]
    time.sleep(1.0)
    assert all(_gone(pid) for pid in ranks), "a rank outlived the run"
    assert (run / "stacks" / "rank1.txt").read_text().count("not answered") == 1  # its stacks were written


def test_a_second_ctrl_c_ends_the_run_at_once(hung_run):
    process, run = hung_run
    ranks = _pids(run)
    process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    sent_at = time.monotonic()
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert time.monotonic() - sent_at < 2.5 and process.returncode == 130, output[-3000:]
    assert "error: a second SIGINT: ending every local rank at once (exit 130)." in output
    time.sleep(1.0)
    assert all(_gone(pid) for pid in ranks)


def test_a_callback_that_runs_the_model_on_one_rank_under_fsdp2_is_named_within_seconds(tmp_path: Path):
    started = time.monotonic()
    result = train(
        tmp_path,
        *user_overrides("LitClassifier"),
        "trainer=fsdp_cpu",
        "trainer.max_epochs=1",
        "+callbacks.sample._target_=tests.differential.user_code.PredictOnRankZero",
        env={"PYTHONPATH": str(ROOT)},
        timeout=180,
    )
    assert result.returncode != 0 and time.monotonic() - started < 90, result.stdout[-3000:]
    errors = {line for line in result.stdout.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, result.stdout[-3000:]
    (error,) = errors
    assert "callbacks.sample runs the model in on_validation_end on rank 0 but not on every rank" in error
    assert "run the model on every rank in on_validation_end" in error
