"""A LightningModule that torch.export cannot trace: its forward branches on the values of its input, a
Python `if` on a tensor (fine in eager mode, which sees the values; a trace sees only shapes)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn


class BranchingClassifier(pl.LightningModule):
    def __init__(self, features: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.bright = nn.Linear(features, classes)
        self.dark = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0.5:
            return self.bright(x)
        return self.dark(x)
