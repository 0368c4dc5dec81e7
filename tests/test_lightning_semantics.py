"""Ordinary Lightning code meets no silent deviation and no confusing failure: resuming with changed
optimizer values, manual optimization under DDP, a package that is not on the path, validation metrics
of any name, and refused commands. (The side-by-side comparison with bare Lightning is in
tests/test_differential.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.runtime.environment import network
from tests.differential.cases import user_overrides
from tests.helpers import ROOT, assert_ok, read_metrics, run_dirs, train

DIGITS = (
    "data=digits",
    "model=mlp",
    "trainer=cpu",
    "trainer.limit_train_batches=5",
    "trainer.limit_val_batches=2",
)


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_resume_says_which_configured_values_the_checkpoint_overrides(tmp_path: Path):
    assert_ok(train(tmp_path, *DIGITS, "trainer.max_epochs=1", "model.optimizer.lr=0.003"))
    (first,) = run_dirs(tmp_path)
    saved = first / "checkpoints" / "last.ckpt"

    same = train(tmp_path, *DIGITS, "trainer.max_epochs=2", "model.optimizer.lr=0.003", f"ckpt_path={saved}")
    assert_ok(same)
    assert "these configured values are not used" not in same.stdout  # same config (a requeue): no line

    changed = train(
        tmp_path, *DIGITS, "trainer.max_epochs=2", "model.optimizer.lr=0.0001", f"ckpt_path={saved}"
    )
    assert_ok(changed)
    assert (
        "so these configured values are not used: model.optimizer.lr=0.0001 (the checkpoint has 0.003)"
        in changed.stdout
    ), changed.stdout[-3000:]
    assert f"init_from.path={saved}" in changed.stdout

    other = train(tmp_path, *DIGITS, "trainer.max_epochs=2", "model/optimizer=sgd", f"ckpt_path={saved}")
    assert other.returncode == 2, other.stdout[-3000:]
    (sentence,) = _errors(other.stdout)
    assert "was trained with model.optimizer._target_=torch.optim.Adam" in sentence
    assert "torch.optim.SGD is configured" in sentence and "Traceback" not in other.stdout


@pytest.mark.slow
def test_unused_parameters_under_ddp_name_the_key(tmp_path: Path):
    result = train(
        tmp_path,
        *user_overrides("TwoOptimizerGAN"),
        "trainer=ddp_cpu",
        "trainer.max_epochs=1",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0
    errors = _errors(result.stdout)
    assert errors and all("dist.find_unused_parameters=true" in e for e in errors), result.stdout[-3000:]
    for line in errors:  # shortened at a word boundary, never mid-word ("...=True to t (traceback above)")
        assert (" to t " not in line and "(traceback above)" in line) or "stopped too" in line, line


@pytest.mark.slow
def test_a_target_that_cannot_be_imported_is_one_sentence(tmp_path: Path):
    result = train(
        tmp_path, "data=digits", "trainer=ddp_cpu", "model=mlp", "model._target_=mypkg.models.LitNet"
    )
    assert result.returncode == 2
    (sentence,) = _errors(result.stdout)
    assert (
        "_target_: mypkg.models.LitNet cannot be imported (ModuleNotFoundError: No module named 'mypkg')"
        in sentence
    )
    assert "PYTHONPATH" in sentence and "rank" not in sentence and "Traceback" not in result.stdout
    assert not (tmp_path / "train" / "runs").exists() or not run_dirs(tmp_path)  # refused: no run dir left


@pytest.mark.slow
def test_the_epoch_line_shows_validation_metrics_whatever_their_names(tmp_path: Path):
    result = train(
        tmp_path,
        *user_overrides("LitClassifier"),  # logs train_loss, val_loss, val_acc
        "trainer=cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
        "callbacks.progress.mode=log",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert_ok(result)
    (line,) = [x for x in result.stdout.splitlines() if "epoch 0 validation" in x]
    assert "val_loss " in line and "val_acc " in line and "train_loss" not in line, line
    assert read_metrics(run_dirs(tmp_path)[0])


def test_network_line_before_the_launcher_picks_a_port():
    line = network.network_summary(1, env={}, hostname="localhost")
    assert "rank 0 at this machine, on a free port chosen when the ranks start" in line
    assert ":a port" not in line


@pytest.mark.slow
def test_a_loss_that_becomes_nan_stops_the_run_naming_the_step_rank_and_last_good_checkpoint(tmp_path: Path):
    """NaN injected at step 23 of a user's module (epoch 1; 20 steps per epoch): one sentence naming
    step 23, the rank and the checkpoint of epoch 0; no checkpoint of the NaN weights is written."""
    import torch

    result = train(
        tmp_path,
        *user_overrides("NaNAtStep"),
        "trainer=cpu",
        "trainer.max_epochs=3",
        "nan.check_every_n_steps=5",
        env={"PYTHONPATH": str(ROOT), "NAN_AT_STEP": "23"},
    )
    (run,) = run_dirs(tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    assert result.returncode == 2, result.stdout[-3000:]
    assert (
        f"error: the training loss became nan at step 23 (epoch 1) on rank 0; the last good checkpoint is {last};"
        in result.stdout
    ), result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert torch.load(last, weights_only=True)["global_step"] == 20  # written at the end of epoch 0, finite
