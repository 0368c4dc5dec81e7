"""A LightningModule that trains a next-symbol model (e.g. `CharTransformer`) with cross-entropy.

Logs train/loss (on logging steps only: each self.log call costs Lightning about half a millisecond),
val/loss and val/bpc, test/loss and test/bpc: bits per character, the loss in base 2. Epoch means are
metric states summed across ranks, so every window counts once under DDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import Tensor, nn
from torch.optim import Optimizer

from myproject.models import optim
from myproject.models.metrics import Mean


class CharLanguageModel(LightningModule):
    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.val_loss, self.test_loss = Mean(), Mean()

    def forward(self, idx: Tensor) -> Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
            self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), batch[0].numel())

    def on_validation_epoch_end(self) -> None:
        # the loss is summed across ranks when computed; bpc is the same number in bits (the same on every rank)
        self.log("val/bpc", self.val_loss.compute() / math.log(2), sync_dist=True)
        self.log("val/loss", self.val_loss, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.test_loss.update(self._loss(batch), batch[0].numel())

    def on_test_epoch_end(self) -> None:
        self.log("test/bpc", self.test_loss.compute() / math.log(2), sync_dist=True)
        self.log("test/loss", self.test_loss)

    def configure_optimizers(self) -> Any:
        return optim.configure(
            self, self.parameters(), self.optimizer_factory, self.scheduler_factory, self.scheduler_interval
        )
