"""Plain nn.Modules. They know nothing of devices, ranks or parallelism: the Trainer does that.

Sizes come from the data's config (`image_shape: ${data.image_shape}`, `num_classes: ${data.num_classes}`),
so the same network config fits MNIST, digits or CIFAR-10.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn


class MNISTCNN(nn.Module):
    """The classic MNIST network: two 5x5 convolutions with max-pooling, then two linear layers
    (320 features into the first linear layer for 1x28x28 images)."""

    def __init__(
        self, image_shape: Sequence[int] = (1, 28, 28), num_classes: int = 10, dropout: float = 0.5
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        self.conv1 = nn.Conv2d(channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()

        def after_convs(size: int) -> int:  # two (5x5 conv, 2x2 max-pool) stages
            return ((size - 4) // 2 - 4) // 2

        features = 20 * after_convs(height) * after_convs(width)
        self.fc1 = nn.Linear(features, 50)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


class MLP(nn.Module):
    """Flatten, then Linear -> BatchNorm -> ReLU blocks, then a linear classifier."""

    def __init__(
        self,
        image_shape: Sequence[int] = (1, 28, 28),
        hidden_sizes: Sequence[int] = (256, 256, 256),
        num_classes: int = 10,
        batch_norm: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(image_shape)
        for hidden in hidden_sizes:
            layers += [
                nn.Linear(width, hidden),
                nn.BatchNorm1d(hidden) if batch_norm else nn.Identity(),
                nn.ReLU(),
            ]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def torchvision_resnet18(image_shape: Sequence[int] = (3, 224, 224), num_classes: int = 1000) -> nn.Module:
    """torchvision's own ResNet-18 (7x7 stem and max-pool, for ImageNet-sized images), with no weights:
    its keys are torchvision's, so a state dict saved from torchvision (or its pretrained weights, copied
    to an offline cluster) loads with `init_from.prefix=net. init_from.exclude=['^net[.]fc[.]']`.
    Images of other than 3 channels get a first convolution of their own (leave `net.conv1.` out too)."""
    from torchvision.models import resnet18

    net = resnet18(weights=None, num_classes=int(num_classes))
    if int(image_shape[0]) != 3:
        net.conv1 = nn.Conv2d(int(image_shape[0]), 64, kernel_size=7, stride=2, padding=3, bias=False)
    return net
