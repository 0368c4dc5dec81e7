"""One LightningModule for image classification; the network, optimizer and schedule come from config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import MaxMetric

from myproject.models import optim
from myproject.models.metrics import Accuracy, Mean


class ImageClassifier(LightningModule):
    """Trains `net` with cross-entropy and logs train/loss (every log_every_n_steps), train/acc,
    val/loss, val/acc, val/acc_best, test/loss and test/acc (once per epoch); predicts the class and the
    probabilities.

    Accuracy and loss are metric states summed across ranks when an epoch ends, so with DDP every
    sample counts once and no collective runs per step. `val/acc_best` is part of the state dict, so
    it survives a resume. Hyperparameters are not pickled into checkpoints (the network is an
    nn.Module); the resolved config is stored there instead, and checkpoints load with
    `weights_only=True`.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "epoch",
        num_classes: int = 10,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.train_acc, self.val_acc, self.test_acc = Accuracy(), Accuracy(), Accuracy()
        self.val_loss, self.test_loss = Mean(), Mean()
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss_and_predictions(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        smoothing = self.label_smoothing if self.training else 0.0
        return F.cross_entropy(logits, y, label_smoothing=smoothing), logits.argmax(dim=1), y

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, preds, y = self._loss_and_predictions(batch)
        self.train_acc.update(preds, y)
        # Each self.log call has a fixed cost in Lightning that can match a small model's whole step;
        # log the loss only on the steps the loggers write (every log_every_n_steps).
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
            self.log("train/loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        # Logging the metric object: Lightning computes it (summed across ranks) and resets it.
        self.log("train/acc", self.train_acc)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, preds, y = self._loss_and_predictions(batch)
        self.val_loss.update(loss, len(y))
        self.val_acc.update(preds, y)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        if self.trainer.sanity_checking:  # logged, so it can be monitored, but not counted as a best
            best = acc
        else:
            self.val_acc_best.update(acc)
            best = self.val_acc_best.compute()
        # the same value on every rank; sync_dist only tells Lightning so (one tiny all-reduce per epoch)
        self.log("val/acc_best", best, sync_dist=True)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, preds, y = self._loss_and_predictions(batch)
        self.test_loss.update(loss, len(y))
        self.test_acc.update(preds, y)

    def on_test_epoch_end(self) -> None:
        self.log("test/loss", self.test_loss)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """The class and the probability of every class, per sample (src/predict.py writes them as CSV)."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        probs = self(images).float().softmax(dim=1)
        return {"class": probs.argmax(dim=1), "probs": probs}

    def configure_optimizers(self) -> Any:
        return optim.configure(
            self, self.parameters(), self.optimizer_factory, self.scheduler_factory, self.scheduler_interval
        )
