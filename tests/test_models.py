"""Networks take their sizes from the data; the classifier's metrics, optimizers and schedules behave."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from myproject.models import optim
from myproject.models.classifier import ImageClassifier
from myproject.models.metrics import Accuracy, Mean
from myproject.models.nets import MLP, MNISTCNN


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
@pytest.mark.parametrize("net_class", [MNISTCNN, MLP])
def test_networks_fit_the_image_shape_and_class_count(net_class, shape):
    net = net_class(image_shape=shape, num_classes=7)
    assert net(torch.randn(3, *shape)).shape == (3, 7)


def test_the_classic_cnn_keeps_its_320_features_on_mnist():
    assert MNISTCNN().fc1.in_features == 320


def test_best_validation_accuracy_is_kept_in_the_state_dict():
    model = ImageClassifier(MLP(), optimizer=torch.optim.SGD)
    model.val_acc_best.update(torch.tensor(0.75))
    restored = ImageClassifier(MLP(), optimizer=torch.optim.SGD)
    restored.load_state_dict(model.state_dict())
    assert float(restored.val_acc_best.compute()) == 0.75


def test_metrics_weight_every_sample_equally():
    accuracy, mean = Accuracy(), Mean()
    accuracy.update(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0]))
    accuracy.update(torch.tensor([4]), torch.tensor([4]))
    mean.update(torch.tensor(1.0), 3)
    mean.update(torch.tensor(5.0), 1)
    assert float(accuracy.compute()) == 0.75 and float(mean.compute()) == 2.0


def _module(max_epochs: int = 4, steps: int = 40):
    net = torch.nn.Linear(2, 2)
    return net, SimpleNamespace(
        trainer=SimpleNamespace(max_epochs=max_epochs, estimated_stepping_batches=steps)
    )


def test_schedule_lengths_come_from_the_trainer():
    net, module = _module()
    cosine = partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=None)
    configured = optim.configure(module, net.parameters(), partial(torch.optim.SGD, lr=0.1), cosine, "step")
    assert (
        configured["lr_scheduler"]["scheduler"].T_max == 40
        and configured["lr_scheduler"]["interval"] == "step"
    )
    onecycle = partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1, total_steps=None)
    configured = optim.configure(module, net.parameters(), partial(torch.optim.SGD, lr=0.1), onecycle, "step")
    assert configured["lr_scheduler"]["scheduler"].total_steps == 40
    epochs = optim.configure(module, net.parameters(), partial(torch.optim.SGD, lr=0.1), cosine, "epoch")
    assert epochs["lr_scheduler"]["scheduler"].T_max == 4


def test_no_schedule_is_just_the_optimizer():
    net, module = _module()
    for empty in (None, {}):
        built = optim.configure(module, net.parameters(), partial(torch.optim.SGD, lr=0.1), empty)
        assert isinstance(built, torch.optim.SGD)
