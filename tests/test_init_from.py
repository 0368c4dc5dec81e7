"""Fine-tuning: `init_from` starts a new run from weights (a fresh optimizer, epoch 0, its own run dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run.checkpoints import init_from
from hpctrain.runtime.run.checkpoints.contents import AtomicCheckpointIO
from tests.helpers import assert_ok, run_dirs, train


class _Classifier(torch.nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, classes)
        )


def test_a_plain_state_dict_loads_with_a_prefix(tmp_path: Path):
    source = _Classifier().net
    torch.save(source.state_dict(), tmp_path / "net.pt")
    target = _Classifier()
    line = init_from.apply(target, tmp_path / "net.pt", prefix="net.")
    assert "loaded 9 of the model's 9 tensors" in line
    assert torch.equal(target.net[0].weight, source[0].weight)


def test_a_lightning_checkpoint_loads_its_state_dict(tmp_path: Path):
    source = _Classifier()
    AtomicCheckpointIO().save_checkpoint({"state_dict": source.state_dict(), "epoch": 3}, tmp_path / "x.ckpt")
    target = _Classifier()
    init_from.apply(target, tmp_path / "x.ckpt")
    assert all(
        torch.equal(a, b)
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )


def test_a_mismatch_is_one_sentence_listing_the_keys(tmp_path: Path):
    torch.save(_Classifier(classes=3).state_dict(), tmp_path / "other.pt")
    with pytest.raises(UserError) as caught:
        init_from.apply(_Classifier(), tmp_path / "other.pt")
    sentence = str(caught.value)
    assert "2 of another shape (net.2.bias [3] vs [10], net.2.weight [3, 8] vs [10, 8])" in sentence
    assert "init_from.strict=false" in sentence and "init_from.exclude" in sentence


def test_non_strict_with_exclude_loads_the_rest_and_says_what_was_left_out(tmp_path: Path):
    source = _Classifier(classes=3)
    torch.save(source.state_dict(), tmp_path / "other.pt")
    target = _Classifier()
    line = init_from.apply(target, tmp_path / "other.pt", strict=False, exclude=[r"^net\.2\."])
    assert "loaded 7 of the model's 9 tensors" in line and "left out by init_from.exclude: 2" in line
    assert torch.equal(target.net[0].weight, source.net[0].weight)


def test_frozen_parts_keep_weights_and_batchnorm_statistics(tmp_path: Path):
    model = _Classifier()
    frozen = init_from.FrozenParts(model, [r"^net\.[01]\."])
    assert frozen.norms == ["net.1"] and not model.net[0].weight.requires_grad
    with pytest.raises(UserError, match="matches no parameter"):
        init_from.FrozenParts(_Classifier(), ["^nothing"])


@pytest.mark.slow
def test_fine_tuning_starts_a_new_run_from_weights_and_freezes(tmp_path: Path):
    digits = (
        "data=digits",
        "model=mlp",
        "trainer=cpu",
        "trainer.limit_train_batches=5",
        "trainer.limit_val_batches=2",
    )
    assert_ok(train(tmp_path, *digits, "trainer.max_epochs=1"))
    (first,) = run_dirs(tmp_path)
    saved = first / "checkpoints" / "last.ckpt"

    both = train(tmp_path, *digits, f"ckpt_path={saved}", f"init_from.path={saved}")
    assert both.returncode == 2 and "pass one of them" in both.stdout

    result = train(
        tmp_path,
        *digits,
        "trainer.max_epochs=2",
        f"init_from.path={saved}",
        "init_from.freeze=['^net[.]layers[.][12][.]']",
    )
    assert_ok(result)
    assert "starting fresh" in result.stdout and "init_from: loaded" in result.stdout
    second = next(d for d in run_dirs(tmp_path) if d != first)
    before = torch.load(saved, weights_only=True)["state_dict"]
    after = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    assert after["epoch"] == 1  # a new run: its own two epochs, counted from 0
    frozen = [
        k for k in before if k.startswith(("net.layers.1.", "net.layers.2."))
    ]  # a linear and its BatchNorm
    assert frozen and all(torch.equal(before[k], after["state_dict"][k]) for k in frozen)
    assert not all(torch.equal(before[k], after["state_dict"][k]) for k in before if k not in frozen)
