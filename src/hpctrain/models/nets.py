"""Plain nn.Modules. They know nothing of devices, ranks or parallelism: the Trainer does that."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class MNISTCNN(nn.Module):
    """The classic MNIST network: two 5x5 convolutions with max-pooling, then two linear layers."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
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
        input_size: int = 784,
        hidden_sizes: tuple[int, ...] = (256, 256, 256),
        num_classes: int = 10,
        batch_norm: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = input_size
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
