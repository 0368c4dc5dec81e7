import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class MyModel(pl.LightningModule):
    """A small MLP classifier; its inputs arrive normalised (float, mean 0, std 1 per channel)."""

    def __init__(self, num_classes: int, image_shape: list[int], hidden: int = 128, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        channels, height, width = image_shape
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * height * width, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
