"""Each model trains on each dataset (fast_dev_run), and the classifier's metrics behave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain import build
from hpctrain.models.classifier import ImageClassifier
from hpctrain.models.nets import MLP, MNISTCNN
from tests.helpers import compose_train

MODELS = ("mnist_cnn", "mlp")
DATA = ("mnist", "fashion_mnist", "digits", "random")


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("model", MODELS)
def test_fast_dev_run(model: str, data: str, tmp_path: Path, mnist_dir: Path):
    extra = ["data.val_size=100"] if "mnist" in data else []
    cfg = compose_train(
        tmp_path, mnist_dir, f"model={model}", f"data={data}", "debug=fdr", "trainer=cpu", *extra
    )
    datamodule = build.datamodule(cfg)
    datamodule.check_available()
    module = build.model(cfg)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = build.trainer(cfg, tmp_path)
    trainer.fit(module, datamodule)
    trainer.test(module, datamodule)
    assert any(
        not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)
    )  # it learned something
    assert 0.0 <= float(trainer.callback_metrics["test/acc"]) <= 1.0
    assert torch.isfinite(trainer.callback_metrics["test/loss"])


@pytest.mark.parametrize("net", [MNISTCNN(), MLP()])
def test_networks_map_mnist_images_to_ten_logits(net: torch.nn.Module):
    assert net(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_best_validation_accuracy_is_kept_in_the_state_dict():
    model = ImageClassifier(MLP(), optimizer=torch.optim.SGD)
    model.val_acc_best.update(torch.tensor(0.75))
    restored = ImageClassifier(MLP(), optimizer=torch.optim.SGD)
    restored.load_state_dict(model.state_dict())
    assert float(restored.val_acc_best.compute()) == 0.75
