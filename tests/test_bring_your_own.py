"""The guide "Your model" (docs/guides/your-model.md): each worked case (src/myproject/examples/) trains with DDP on CPU,
resumes from ckpt_path and is evaluated by eval.py, with exactly the commands the guide shows; a
misnamed monitored metric and classes of both Lightning namespaces in one run each stop with one sentence."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    PYTHON,
    ROOT,
    assert_ok,
    local_env,
    read_metrics,
    run_dirs,
    run_entry,
    run_script,
    train,
)

pytestmark = pytest.mark.slow

# The README's commands for the three cases (plus this test's log dir and a short run).
CASES = {
    "plain_net": ("model/net=small_convnet", "data=digits"),
    "lightning_module": ("model=autoencoder", "data=digits"),
    "plain_datamodule": ("data=plain_digits",),
}
QUICK = ("trainer.max_epochs=1", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2")


def _one_sentence_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
    return errors[0]


@pytest.mark.parametrize("case", CASES)
def test_worked_case_trains_with_ddp_resumes_and_evaluates(case: str, tmp_path: Path):
    assert_ok(train(tmp_path, *CASES[case], "trainer=ddp_cpu", *QUICK))
    (first,) = run_dirs(tmp_path)
    last = first / "checkpoints" / "last.ckpt"

    resumed = train(
        tmp_path, *CASES[case], "trainer=ddp_cpu", *QUICK, "trainer.max_epochs=2", f"ckpt_path={last}"
    )
    assert_ok(resumed)
    assert f"starting from {last}" in resumed.stdout
    second = next(r for r in run_dirs(tmp_path) if r != first)
    trained = {
        row["epoch"]
        for row in read_metrics(second)
        if any(k.startswith("train") and v for k, v in row.items())
    }
    assert trained == {"1"}  # continued at epoch 1

    evaluated = run_entry(
        "eval.py", f"paths.log_dir={tmp_path}", f"ckpt_path={second / 'checkpoints' / 'last.ckpt'}"
    )
    assert_ok(evaluated)
    (eval_run,) = run_dirs(tmp_path, task="eval")
    assert any(
        key.startswith("test") and value for row in read_metrics(eval_run) for key, value in row.items()
    )


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (
            ("model=autoencoder", "monitor.metric=val_los"),
            "error: monitor.metric=val_los is never logged by the model (it logged: val_loss); "
            "did you mean monitor.metric=val_loss?",
        ),
        (("monitor.metric=val/accuracy",), "error: monitor.metric=val/accuracy is never logged by the model"),
    ],
)
def test_a_metric_that_is_never_logged_stops_the_run_after_the_sanity_check(
    tmp_path: Path, overrides, sentence
):
    started = time.monotonic()
    result = train(tmp_path, "data=digits", "trainer=cpu", "callbacks.progress.log_every_n_s=0", *overrides)
    message = _one_sentence_error(result)
    assert message.startswith(sentence), message
    assert "epoch 0/" not in result.stdout  # stopped before the first training step
    assert time.monotonic() - started < 60
    (run,) = run_dirs(tmp_path)
    assert not (run / "checkpoints").exists()


def test_without_a_sanity_check_it_stops_at_the_first_validation(tmp_path: Path):
    result = train(
        tmp_path, "data=digits", "trainer=cpu", "monitor.metric=val_acc", "trainer.num_sanity_val_steps=0"
    )
    assert "monitor.metric=val_acc is never logged" in _one_sentence_error(result)
    assert "epoch 1/" not in result.stdout


SHORT_RUNS = {
    "max_steps mid-epoch": (("trainer.max_steps=2",), "training ended at step 2 (trainer.max_steps=2)"),
    "no validation batches": (
        ("trainer.limit_val_batches=0", "trainer.limit_train_batches=2", "trainer.max_epochs=1"),
        "no validation ran (trainer.limit_val_batches=0)",
    ),
}


@pytest.mark.parametrize("case", SHORT_RUNS)
def test_a_run_that_ends_before_its_first_validation_completes_with_last_ckpt(tmp_path: Path, case: str):
    """A smoke run (the sanity check validated, then training stopped before the first real validation)
    is a run: completed, last.ckpt saved and tested, and one line saying no validation ran; the monitored
    metric is not 'never logged', it is not computed yet."""
    overrides, why = SHORT_RUNS[case]
    result = train(tmp_path, "experiment=quickstart", "trainer.num_sanity_val_steps=1", *overrides)
    assert_ok(result)
    assert "never logged" not in result.stdout
    (run,) = run_dirs(tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    log = (run / "train.log").read_text()
    assert why in log
    assert "so monitor.metric=val/acc has no value and this run has no best checkpoint; last.ckpt" in log
    assert f"last checkpoint: {last}" in log  # the one the test after fit used
    outcome = yaml.safe_load((run / "outcome.yaml").read_text())
    assert outcome["status"] == "completed" and outcome["value"] is None and outcome["test"], outcome


def test_classes_of_both_lightning_namespaces_in_one_run_are_one_sentence_before_anything_is_built(
    tmp_path: Path,
):
    """A module written with `import lightning as L` runs (tests/test_namespaces.py); with the guide's case (c),
    a datamodule written with `import pytorch_lightning as pl`, it is one sentence naming both files, before
    any data is read or process started."""
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "lit_user.py").write_text(
        textwrap.dedent(
            """
            import lightning as L
            import torch

            class LitUser(L.LightningModule):  # written as the `lightning` package's docs write it
                def __init__(self):
                    super().__init__()
                    self.layer = torch.nn.Linear(784, 10)
            """
        )
    )
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "lit_user.yaml").write_text("_target_: lit_user.LitUser\n")
    started = time.monotonic()
    result = train(
        tmp_path,
        f"--config-dir={tmp_path / 'conf'}",
        "model=lit_user",
        "data=plain_digits",
        "trainer=ddp_cpu",
        env={"PYTHONPATH": str(package)},
    )
    message = _one_sentence_error(result)
    assert message.startswith(
        f"error: model: lit_user.LitUser is written with lightning.pytorch (`import lightning as L`, in "
        f"{package / 'lit_user.py'}), but data: myproject.examples.plain_digits.PlainDigitsDataModule is written "
        f"with pytorch_lightning (`import pytorch_lightning as pl`, in {ROOT / 'src/myproject/examples/plain_digits.py'})"
    ), message
    assert "GPU available" not in result.stdout and "rank" not in message  # no trainer, no second process
    assert time.monotonic() - started < 60
    assert not (tmp_path / "train" / "runs").exists() or not run_dirs(tmp_path)  # refused: no run dir left


def test_a_plain_dataloader_resumes_from_the_last_step_and_says_so(tmp_path: Path):
    """SIGTERM mid-epoch saves requeue.ckpt; resuming a plain DataLoader restarts the epoch's data
    without restoring the epoch's metric counts, and warns once (one epoch: the resume finishes it)."""
    args = [
        PYTHON,
        "src/train.py",
        f"paths.log_dir={tmp_path}",
        "data=plain_digits",
        "data.batch_size=8",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "callbacks.progress.log_every_n_s=0",
        "extras.print_config=false",
    ]
    process = subprocess.Popen(
        args, cwd=ROOT, env=local_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = []
    for line in process.stdout:  # type: ignore[union-attr]
        output.append(line)
        if "epoch 0/1  step 30/" in line:
            process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    (run,) = run_dirs(tmp_path)
    saved = run / "checkpoints" / "requeue.ckpt"
    assert saved.is_file(), "".join(output)[-3000:]

    result = train(
        tmp_path,
        "data=plain_digits",
        "data.batch_size=8",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=2",
        "test=false",
        f"ckpt_path={saved}",
    )
    assert_ok(result)
    assert (
        result.stdout.count("resumed mid-epoch with a train dataloader that cannot resume (DataLoader") == 1
    )
    assert (
        "Consider using an end-of-epoch checkpoint" not in result.stdout
    )  # Lightning's own warning is ours now


def test_prepare_data_takes_any_datamodule():
    result = run_script("scripts/prepare_data.py", "data=plain_digits")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "PlainDigitsDataModule: 1257 train, 180 val, 360 test samples ready" in result.stdout
