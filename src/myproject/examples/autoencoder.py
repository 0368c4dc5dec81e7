"""Case (b): a complete LightningModule, written as Lightning's documentation writes one (its first
example, the autoencoder), with its own training_step and metric names (train_loss, val_loss: lower
is better). Nothing in it knows about the template, ranks or devices."""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class LitAutoEncoder(pl.LightningModule):
    def __init__(self, image_shape: list[int], hidden: int = 64, code: int = 3, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain numbers and lists: checkpoints still load with weights_only
        size = 1
        for dim in image_shape:
            size *= dim
        self.encoder = nn.Sequential(nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, code))
        self.decoder = nn.Sequential(nn.Linear(code, hidden), nn.ReLU(), nn.Linear(hidden, size))

    def _reconstruction_loss(self, batch):
        x, _ = batch
        x = x.view(x.size(0), -1)
        return F.mse_loss(self.decoder(self.encoder(x)), x)

    def training_step(self, batch, batch_idx):
        loss = self._reconstruction_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._reconstruction_loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._reconstruction_loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
