"""One LightningModule for image classification; the network, optimizer and scheduler come from config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy


class ImageClassifier(LightningModule):
    """Trains `net` with cross-entropy and logs train/loss (every log_every_n_steps), train/acc,
    val/loss, val/acc, val/acc_best, test/loss and test/acc (once per epoch).

    Accuracy and loss are torchmetrics states summed across ranks when an epoch ends, so with DDP
    every sample counts once and no collective runs per step. `val/acc_best` is part of the state
    dict, so it survives a resume. Hyperparameters are not pickled into checkpoints (the network is
    an nn.Module); the resolved config is stored there instead, and checkpoints load with
    `weights_only=True`.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "epoch",
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        # validate_args=False: input checks cost a device sync per step; the shapes are ours.
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss_and_predictions(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, preds, y = self._loss_and_predictions(batch)
        self.train_acc.update(preds, y)
        # Each self.log call costs Lightning about half a millisecond, as much as a whole MLP step on
        # a CPU core; log the loss only on the steps the loggers write (every log_every_n_steps).
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train/acc", self.train_acc.compute())  # summed across ranks by torchmetrics
        self.train_acc.reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, preds, y = self._loss_and_predictions(batch)
        self.val_loss.update(loss, weight=len(y))
        self.val_acc.update(preds, y)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_acc_best.update(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, preds, y = self._loss_and_predictions(batch)
        self.test_loss.update(loss, weight=len(y))
        self.test_acc.update(preds, y)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "interval": self.scheduler_interval,
                "monitor": "val/loss",
            },
        }
