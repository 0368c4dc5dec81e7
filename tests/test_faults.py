"""Faults, as real processes: a rank that dies or raises ends the whole DDP job within seconds, naming
it; a process killed while saving leaves the previous checkpoint whole; signals outside training
(startup, testing) end the run cleanly through the template's own path."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers import PYTHON, ROOT, assert_ok, local_env, run_dirs, train

pytestmark = pytest.mark.slow

DDP = (
    "experiment=quickstart",
    "trainer=ddp_cpu",
    "data.batch_size=8",
    "trainer.max_epochs=3",
    "callbacks.progress.log_every_n_s=0",
    "extras.print_config=false",
)


class Run:
    """`python src/train.py ...` in the background, its output collected line by line."""

    def __init__(self, log_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
        self.process = psutil.Popen(
            [PYTHON, "src/train.py", f"paths.log_dir={log_dir}", *overrides],
            cwd=ROOT,
            env={**local_env(), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for line in self.process.stdout:
            self.lines.append(line)
            if text in line:
                return
            assert time.monotonic() < deadline, self.output[-3000:]
        raise AssertionError(f"never printed {text!r}:\n{self.output[-3000:]}")

    def finish(self, timeout: float) -> int:
        started = time.monotonic()
        self.lines += self.process.stdout.readlines()
        code = self.process.wait(timeout=max(1, timeout - (time.monotonic() - started)))
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def child(self) -> psutil.Process:
        (child,) = self.process.children()
        return child


def test_a_killed_rank_ends_the_job_at_once_naming_it(tmp_path: Path):
    run = Run(tmp_path, *DDP)
    run.wait_for("epoch 0/3  step 20/")
    child = run.child()
    child.kill()
    killed_at = time.monotonic()
    assert run.finish(timeout=30) == 1
    assert time.monotonic() - killed_at < 15
    assert f"error: rank 1 (pid {child.pid}) was killed by SIGKILL" in run.output


def test_a_killed_rank_zero_takes_its_children_along(tmp_path: Path):
    run = Run(tmp_path, *DDP)
    run.wait_for("epoch 0/3  step 20/")
    child = run.child()
    run.process.kill()
    run.finish(timeout=30)
    _, alive = psutil.wait_procs([child], timeout=15)
    assert not alive
    assert "error: rank 0 (the process that started rank 1) has died; ending rank 1 too." in run.output


USER_MODULE = """
from myproject.models.classifier import ImageClassifier


class FlakyClassifier(ImageClassifier):
    '''The template's classifier, crashing on rank 1 only, at step 5 (like a bad sample or an OOM).'''

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 5:
            raise RuntimeError("injected failure on one rank")
        return super().training_step(batch, batch_idx)
"""


def flaky_model(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """--config-dir and PYTHONPATH that make `model=flaky` the classifier above (a user's own module)."""
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "flaky.py").write_text(textwrap.dedent(USER_MODULE))
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "flaky.yaml").write_text("defaults: [mnist_cnn, _self_]\n_target_: flaky.FlakyClassifier\n")
    return [f"--config-dir={tmp_path / 'conf'}", "model=flaky"], {"PYTHONPATH": str(package)}


def test_an_exception_in_one_rank_ends_the_job_naming_that_rank(tmp_path: Path):
    args, env = flaky_model(tmp_path)
    started = time.monotonic()
    result = train(tmp_path, *args, *DDP, env=env, timeout=120)
    assert result.returncode == 1
    assert time.monotonic() - started < 60
    assert (
        "rank 1 on " in result.stdout
        and "failed: RuntimeError: injected failure on one rank" in result.stdout
    )
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert errors and all("rank 1 on" in line for line in errors), errors  # rank 0 names rank 1, not itself


@pytest.mark.ondemand  # tests/test_commit_kills.py kills a save at each of its steps, in CI
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_whole(tmp_path: Path):
    """A big model makes each save take long enough to be killed in the middle of it."""
    big = ("model=mlp", "model.net.hidden_sizes=[2048,2048,2048]", "data=digits", "trainer=cpu")
    run = Run(
        tmp_path, *big, "trainer.max_epochs=3", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"
    )
    run.wait_for("epoch 0 validation")
    (run_dir,) = run_dirs(tmp_path)
    checkpoints = run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints / "last.ckpt").is_file():  # the first complete save
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["epoch"]
    while not list(checkpoints.glob(".*.tmp-*")):  # a later save in progress
        assert time.monotonic() < deadline and run.process.poll() is None, run.output[-2000:]
    run.process.kill()
    run.finish(timeout=30)
    assert list(checkpoints.glob(".*.tmp-*")), "the save finished before the kill; the test proves nothing"
    kept = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert kept["epoch"] == first  # whole, and the one before the interrupted save

    resumed = train(tmp_path, *big, "trainer.max_epochs=3", "trainer.limit_train_batches=2", "ckpt_path=last")
    assert_ok(resumed)
    assert f"starting from {checkpoints / 'last.ckpt'}" in resumed.stdout


def test_a_signal_during_startup_is_acted_on_at_the_first_step(tmp_path: Path):
    run = Run(tmp_path, "experiment=quickstart", "trainer=cpu", "extras.print_config=false")
    time.sleep(1.5)  # still importing: long before training starts
    run.process.send_signal(signal.SIGUSR1)  # the time-limit warning; outside SLURM it means stop
    assert run.finish(timeout=120) == 128 + signal.SIGTERM
    assert "stopped on SIGUSR1 during training: saved" in run.output
    (run_dir,) = run_dirs(tmp_path)
    saved = torch.load(run_dir / "checkpoints" / "requeue.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 1  # the first step boundary


def test_sigterm_during_testing_stops_the_test_cleanly(tmp_path: Path):
    slow_test = ("data=random", "data.test_samples=40000", "data.batch_size=8", "model=mlp", "trainer=cpu")
    run = Run(
        tmp_path,
        *slow_test,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=5",
        "extras.print_config=false",
    )
    run.wait_for("Restoring states from the checkpoint path")  # trainer.test loading the best checkpoint
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 128 + signal.SIGTERM
    assert "stopped on SIGTERM during testing" in run.output
    assert "Traceback" not in run.output and "finished:" not in run.output
