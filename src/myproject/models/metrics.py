"""Metrics summed across ranks once per epoch, with the least work per step.

Each update is a few tensor additions on the device: no host synchronisation (no NaN check, no
tensor made on the host), no input validation. torchmetrics sums the states over all ranks when the
value is computed at the end of an epoch, so under DDP every sample counts exactly once.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class Accuracy(Metric):
    """The fraction of predictions equal to the targets."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        # in place: `self.correct += ...` would also go through Metric.__setattr__ at every step
        self.correct.add_((preds == target).sum())
        self.total.add_(target.numel())

    def compute(self) -> Tensor:
        return self.correct.float() / self.total.clamp(min=1)


class Mean(Metric):
    """The mean of per-batch means, each weighted by its batch's size: the mean over all samples."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("weighted_sum", torch.zeros((), dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, batch_mean: Tensor, batch_size: int | Tensor) -> None:
        # a multiplication, not add_(alpha=...): a device tensor as alpha would be read on the host
        self.weighted_sum.add_(batch_mean.detach().float() * batch_size)
        self.count.add_(batch_size)

    def compute(self) -> Tensor:
        return self.weighted_sum / self.count.clamp(min=1)
