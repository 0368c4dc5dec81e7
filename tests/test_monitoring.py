"""The best checkpoint carried across a resume into a new run dir, unit by unit (the runs that show it
against bare Lightning are in test_differential.py; short runs' monitoring in test_bring_your_own.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hpctrain.callbacks.model_checkpoint import ModelCheckpoint


def _saved(earlier: Path, scores: dict[str, float], mode: str = "max") -> dict:
    """The ModelCheckpoint state a checkpoint of an earlier run (its checkpoint folder `earlier`) holds."""
    best_k = {str(earlier / name): torch.tensor(score) for name, score in scores.items()}
    best = (max if mode == "max" else min)(best_k, key=lambda p: float(best_k[p]))
    return {
        "monitor": "val/acc",
        "best_model_score": best_k[best],
        "best_model_path": best,
        "current_score": None,
        "dirpath": str(earlier),
        "best_k_models": best_k,
        "kth_best_model_path": best,
        "kth_value": best_k[best],
        "last_model_path": str(earlier / "last.ckpt"),
    }


def _files(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


@pytest.mark.parametrize(("mode", "best"), [("max", "epoch_001.ckpt"), ("min", "epoch_000.ckpt")])
def test_a_resume_into_a_new_run_dir_keeps_the_earlier_runs_best(tmp_path: Path, mode: str, best: str):
    earlier = _files(tmp_path / "a" / "checkpoints", "epoch_000.ckpt", "epoch_001.ckpt", "last.ckpt")
    callback = ModelCheckpoint(
        dirpath=tmp_path / "b" / "checkpoints", monitor="val/acc", mode=mode, save_top_k=2
    )
    callback.load_state_dict(_saved(earlier, {"epoch_000.ckpt": 0.2, "epoch_001.ckpt": 0.4}, mode))
    assert callback.best_model_path == str(earlier / best)
    assert float(callback.best_model_score) == pytest.approx({"max": 0.4, "min": 0.2}[mode])
    assert callback.kth_best_model_path == str(
        earlier / ({"epoch_001.ckpt", "epoch_000.ckpt"} - {best}).pop()
    )
    assert callback.last_model_path == ""  # this run's last.ckpt is its own


def test_an_earlier_best_that_is_gone_is_said_and_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    earlier = _files(tmp_path / "a" / "checkpoints", "epoch_000.ckpt", "last.ckpt")  # epoch_001.ckpt deleted
    callback = ModelCheckpoint(
        dirpath=tmp_path / "b" / "checkpoints", monitor="val/acc", mode="max", save_top_k=2
    )
    with caplog.at_level(logging.INFO, logger="hpctrain.runtime.run"):
        callback.load_state_dict(_saved(earlier, {"epoch_000.ckpt": 0.2, "epoch_001.ckpt": 0.4}))
    assert callback.best_k_models == {str(earlier / "epoch_000.ckpt"): torch.tensor(0.2)}
    assert callback.best_model_path == str(earlier / "epoch_000.ckpt")
    assert f"the earlier run's best checkpoint(s) {earlier / 'epoch_001.ckpt'} are gone" in caplog.text


def test_a_resume_in_the_same_run_dir_restores_everything_as_lightning_does(tmp_path: Path):
    here = _files(tmp_path / "a" / "checkpoints", "epoch_001.ckpt")
    callback = ModelCheckpoint(dirpath=here, monitor="val/acc", mode="max")
    state = _saved(here, {"epoch_001.ckpt": 0.4, "epoch_000.ckpt": 0.2})  # epoch_000.ckpt is not on disk
    callback.load_state_dict(state)
    assert (
        callback.best_k_models == state["best_k_models"]
        and callback.last_model_path == state["last_model_path"]
    )
