"""Fine-tuning: `init_from` starts a new run from weights (a fresh optimizer, epoch 0, its own run dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.callbacks.frozen_parts import FrozenParts
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import init_from, reading
from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO
from tests.helpers import assert_ok, require_modules, run_dirs, train


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


def test_a_safetensors_file_loads(tmp_path: Path):
    require_modules("safetensors")
    from safetensors.torch import save_file

    source = _Classifier()
    save_file(source.state_dict(), str(tmp_path / "weights.safetensors"))
    target = _Classifier()
    line = init_from.apply(target, tmp_path / "weights.safetensors")
    assert "loaded 9 of the model's 9 tensors" in line
    assert all(
        torch.equal(a, b)
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )


def test_a_file_of_pickled_objects_is_refused_in_one_sentence(tmp_path: Path):
    torch.save({"model": _Classifier()}, tmp_path / "pickled.pt")  # a whole module: code, not weights
    with pytest.raises(UserError, match="pickled Python objects"):
        init_from.apply(_Classifier(), tmp_path / "pickled.pt")


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
    frozen = FrozenParts(model, [r"^net\.[01]\."])
    assert frozen.norms == ["net.1"] and not model.net[0].weight.requires_grad
    with pytest.raises(UserError, match="matches no parameter"):
        FrozenParts(_Classifier(), ["^nothing"])


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


def test_a_new_run_leaves_the_metric_states_of_the_file_behind(tmp_path: Path):
    from myproject.models.classifier import ImageClassifier
    from myproject.models.nets import MLP

    def classifier() -> ImageClassifier:
        return ImageClassifier(MLP((1, 8, 8), num_classes=10), optimizer=torch.optim.SGD)

    trained = classifier()
    trained.val_acc_best.update(torch.tensor(0.97))  # a persistent metric state: the old run's best
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "old.ckpt")
    fresh = classifier()
    line = init_from.apply(
        fresh, tmp_path / "old.ckpt"
    )  # strict: the metric state is neither loaded nor missing
    assert "loaded" in line and "not loaded" not in line
    assert float(fresh.val_acc_best.max_value) != 0.97
    assert torch.equal(fresh.net.layers[1].weight, trained.net.layers[1].weight)


class _Module(__import__("pytorch_lightning").LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Classifier().net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)


def _fit(module: _Module, callback: FrozenParts, epochs: int) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 10, (64,))), batch_size=16)
    pl.Trainer(
        max_epochs=epochs,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, data)


@pytest.mark.filterwarnings(r"ignore:Found 1 module\(s\) in eval mode")  # the frozen BatchNorm, as meant
def test_unfreezing_at_an_epoch_trains_the_frozen_part_from_then_on():
    torch.manual_seed(0)
    module = _Module()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    frozen_keys = [k for k in start if k.startswith(("net.0.", "net.1."))]  # a linear and its BatchNorm
    frozen = FrozenParts(module, [r"^net\.[01]\."], unfreeze_at_epoch=2)
    assert module.net[0].weight.requires_grad  # requires_grad never changes: DDP's buckets stay right
    _fit(module, frozen, epochs=2)
    after_two = module.state_dict()
    assert all(torch.equal(start[k], after_two[k]) for k in frozen_keys)  # weights and BatchNorm statistics
    assert not torch.equal(start["net.2.weight"], after_two["net.2.weight"])
    _fit(module, FrozenParts(module, [r"^net\.[01]\."], unfreeze_at_epoch=2), epochs=3)
    after_three = module.state_dict()
    assert not torch.equal(start["net.0.weight"], after_three["net.0.weight"])
    assert not torch.equal(start["net.1.running_mean"], after_three["net.1.running_mean"])


@pytest.mark.slow
def test_torchvision_weights_load_into_the_torchvision_net_with_a_new_head(tmp_path: Path):
    """A state dict saved from torchvision's ResNet-18 (no download: random weights), loaded with the
    prefix and exclude the config comment names; the backbone frozen, BatchNorm statistics included."""
    from torchvision.models import resnet18

    weights = resnet18(weights=None).state_dict()  # 1000 classes, as torchvision's pretrained files
    torch.save(weights, tmp_path / "resnet18.pth")
    result = train(
        tmp_path,
        "model/net=torchvision_resnet18",
        "data=random",
        "data.image_shape=[3,32,32]",
        "data.mean=[0.5,0.5,0.5]",
        "data.std=[0.5,0.5,0.5]",
        "data.num_samples=64",
        "data.val_samples=16",
        "data.test_samples=16",
        "data.batch_size=16",
        "trainer=cpu",
        "trainer.max_epochs=1",
        f"init_from.path={tmp_path}/resnet18.pth",
        "init_from.prefix=net.",
        "init_from.exclude=['^net[.]fc[.]']",
        "init_from.freeze=['^net[.](?!fc[.])']",
    )
    assert_ok(result)
    assert f"init_from: loaded 120 of the model's 122 tensors from {tmp_path}/resnet18.pth" in result.stdout
    (run,) = run_dirs(tmp_path)
    after = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    backbone = [k for k in weights if not k.startswith("fc.")]
    assert all(torch.equal(weights[k], after[f"net.{k}"]) for k in backbone)
    assert after["net.fc.weight"].shape == (10, 512)


@pytest.fixture(scope="module")
def mlp_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MLP on digits after a few steps: weights to start from, known to the tests."""
    logs = tmp_path_factory.mktemp("mlp")
    common = (
        "data=digits",
        "model=mlp",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
    )
    assert_ok(train(logs, *common, "trainer.limit_val_batches=1", "test=false"))
    return run_dirs(logs)[0] / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_cpu", "fsdp_cpu"])
def test_unfreezing_keeps_the_ranks_in_step_and_the_part_frozen_until_then(
    strategy: str, mlp_weights: Path, tmp_path: Path
):
    """Frozen through epoch 0 (bit for bit the weights it started from), trained from epoch 1 on, under
    DDP and under FSDP2 (whose sharding replaces the parameters the freeze was set on)."""
    result = train(
        tmp_path,
        "data=digits",
        "model=mlp",
        f"trainer={strategy}",
        "trainer.devices=2",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=2",
        "test=false",
        f"init_from.path={mlp_weights}",
        "init_from.freeze=['^net[.]layers[.][12][.]']",
        "init_from.unfreeze_at_epoch=1",
        "callbacks.model_checkpoint.save_top_k=-1",  # every epoch's checkpoint, to compare
    )
    assert_ok(result)
    assert "init_from: 4 frozen parameters are trained from epoch 1 on" in result.stdout
    (run,) = run_dirs(tmp_path)
    start = torch.load(mlp_weights, weights_only=True)["state_dict"]
    epochs = sorted((run / "checkpoints").glob("epoch_*.ckpt"))
    first, second = (reading.read(p)["state_dict"] for p in epochs)  # files (DDP) or folders (FSDP2)
    frozen = [k for k in first if k.startswith(("net.layers.1.", "net.layers.2."))]
    trained = [k for k in first if k.startswith("net.") and k not in frozen and k.endswith("weight")]
    assert frozen and all(torch.equal(first[k], start[k]) for k in frozen)  # frozen through epoch 0
    assert not any(torch.equal(first[k], start[k]) for k in trained)  # the rest trained
    assert all(torch.equal(first[k], second[k]) is False for k in frozen if k.endswith("weight"))


@pytest.mark.slow
def test_the_finetune_digits_experiment_learns_odd_or_even_from_a_quickstart_checkpoint(
    quickstart_run: Path, tmp_path: Path
):
    from tests.helpers import last_value, read_metrics

    missing = train(tmp_path / "none", "experiment=finetune_digits")
    assert (
        missing.returncode == 2 and "init_from.path" in missing.stdout and "Traceback" not in missing.stdout
    )

    start = quickstart_run / "checkpoints" / "last.ckpt"  # the README's quickstart, as the config says
    result = train(
        tmp_path / "finetune", "experiment=finetune_digits", f"init_from.path={start}", "trainer.max_epochs=2"
    )
    assert_ok(result)
    assert "init_from: loaded 6 of the model's 8 tensors" in result.stdout  # all but the ten-class head
    assert "left out by init_from.exclude: 2" in result.stdout
    (run,) = run_dirs(tmp_path / "finetune")
    before = torch.load(start, weights_only=True)["state_dict"]
    after = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("net.conv"))
    assert after["net.fc2.weight"].shape == (2, 50)
    assert last_value(read_metrics(run), "test/acc") > 0.9  # odd or even, from frozen digit features
