"""Public Lightning code as real projects write it, for the suite: none of it knows the template.

Each class follows the style of a public codebase users bring (its idioms, not its size: every model is
small and trains on scikit-learn's digits in seconds):

- `GAN`: Lightning's GAN example: manual optimization, two optimizers, generated samples logged as images
  through `self.logger.experiment.add_image` (written with `import lightning as L`);
- `TransferLearningModel` with `MilestonesFinetuning`: Lightning's fine-tuning example: a "pretrained"
  backbone read from a file in `__init__`, frozen, unfrozen at milestones into new param groups;
- `MetricsClassifier`: a Hydra-zen template's model: the network and a partial optimizer as arguments,
  a torchmetrics `MetricCollection` logged with `log_dict`;
- `LogisticRegression`: a PyPI library's linear classifier: `sync_dist=True` logging and a per-step
  OneCycleLR sized by `trainer.estimated_stepping_batches`;
- `EMAWeightAveraging`: an EMA callback subclassing Lightning's `WeightAveraging` (lightning);
- `ReversePredictor` on `ReverseDataset`: the UvA deep-learning tutorial's Transformer, with its cosine
  warm-up schedule computed with numpy, and data given with `LightningDataModule.from_datasets`.

tests/test_corpus.py trains each as fit, under DDP, resumed and evaluated, beside a bare Trainer of its
package (tests/differential/bare.py), through the harness of tests/differential/cases.py.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.callbacks import WeightAveraging
from pytorch_lightning.callbacks import BaseFinetuning
from torch import nn, optim
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils import data
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from tests.differential.user_code import NOTES, DigitsData, _digits

# ------------------------------------------------------------------------------------ Lightning's GAN


class DigitImages(L.LightningDataModule):
    """The digits as 1x8x8 images in [-1, 1] (the GAN example's MNIST, smaller)."""

    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        x, y = _digits(640)
        self.train_set = TensorDataset(x.view(-1, 1, 8, 8) * 2 - 1, y)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple[int, ...]):
        super().__init__()
        self.img_shape = img_shape
        self.model = nn.Sequential(
            nn.Linear(latent_dim, 64), nn.LeakyReLU(0.2), nn.Linear(64, int(np.prod(img_shape))), nn.Tanh()
        )

    def forward(self, z):
        return self.model(z).view(z.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...]):
        super().__init__()
        self.model = nn.Sequential(
            nn.Flatten(),
            nn.Linear(int(np.prod(img_shape)), 32),
            nn.LeakyReLU(0.2),
            nn.Linear(32, 1),
            nn.Sigmoid(),
        )

    def forward(self, img):
        return self.model(img)


class GAN(L.LightningModule):
    def __init__(self, latent_dim: int = 16, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        img_shape = (1, 8, 8)
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)
        self.validation_z = torch.randn(8, self.hparams.latent_dim)
        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z):
        return self.generator(z)

    def adversarial_loss(self, y_hat, y):
        return F.binary_cross_entropy(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch
        optimizer_g, optimizer_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)

        self.toggle_optimizer(optimizer_g)
        self.generated_imgs = self(z)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        self.toggle_optimizer(optimizer_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []

    def on_train_epoch_end(self):
        z = self.validation_z.type_as(self.generator.model[0].weight)
        grid = torchvision.utils.make_grid(self(z))
        self.logger.experiment.add_image("generated_images", grid, self.current_epoch)


# ----------------------------------------------------------------------- Lightning's fine-tuning example


def backbone() -> nn.Sequential:
    """The "pretrained" network: its weights come from a file (tests/test_corpus.py writes it once)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
    )


class ImageDigits(DigitsData):
    """The digits as 1x8x8 images (the fine-tuning example's folder of cats and dogs, smaller)."""

    def setup(self, stage=None):
        super().setup(stage)
        for name in ("train_set", "val_set", "test_set"):
            x, y = getattr(self, name).tensors
            setattr(self, name, TensorDataset(x.view(-1, 1, 8, 8), y))


class MilestonesFinetuning(BaseFinetuning):
    def __init__(self, milestones: tuple = (1, 2), train_bn: bool = False):
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module: pl.LightningModule):
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: optim.Optimizer):
        if epoch == self.milestones[0]:
            # unfreeze the last layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[-3:], optimizer=optimizer, train_bn=self.train_bn
            )
        elif epoch == self.milestones[1]:
            # unfreeze the remaining layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[:-3], optimizer=optimizer, train_bn=self.train_bn
            )


class TransferLearningModel(pl.LightningModule):
    def __init__(
        self,
        backbone_path: str,
        train_bn: bool = False,
        milestones: tuple = (1, 2),
        lr: float = 1e-2,
        lr_scheduler_gamma: float = 0.5,
    ):
        super().__init__()
        self.backbone_path = backbone_path
        self.train_bn = train_bn
        self.milestones = list(milestones)
        self.lr = lr
        self.lr_scheduler_gamma = lr_scheduler_gamma
        self.__build_model()
        self.train_acc = MulticlassAccuracy(num_classes=10)
        self.valid_acc = MulticlassAccuracy(num_classes=10)
        self.save_hyperparameters()
        NOTES["inits"] = NOTES.get("inits", 0) + 1  # a constructor that reads a file and counts itself

    def __build_model(self):
        network = backbone()
        network.load_state_dict(torch.load(self.backbone_path, weights_only=True))  # the "download"
        self.feature_extractor = network
        self.fc = nn.Sequential(nn.Linear(16 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 10))
        self.loss_func = F.cross_entropy

    def forward(self, x):
        return self.fc(self.feature_extractor(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_logits = self.forward(x)
        train_loss = self.loss_func(y_logits, y)
        self.log("train_acc", self.train_acc(y_logits, y), prog_bar=True)
        self.log("train_loss", train_loss, prog_bar=True)
        return train_loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_logits = self.forward(x)
        self.log("val_loss", self.loss_func(y_logits, y), prog_bar=True)
        self.log("val_acc", self.valid_acc(y_logits, y), prog_bar=True)

    def configure_optimizers(self):
        parameters = list(self.parameters())
        trainable_parameters = list(filter(lambda p: p.requires_grad, parameters))
        optimizer = optim.Adam(trainable_parameters, lr=self.lr)
        scheduler = optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma
        )
        return [optimizer], [scheduler]


# ------------------------------------------------------------------- a Hydra-zen template's model


class MetricsClassifier(pl.LightningModule):
    """The network and a partial optimizer come from the config (written as Hydra users write them)."""

    def __init__(self, net: nn.Module, optimizer, num_classes: int = 10):
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        metrics = MetricCollection(
            {"acc": MulticlassAccuracy(num_classes), "f1": MulticlassF1Score(num_classes, average="macro")}
        )
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def forward(self, x):
        return self.net(x)

    def step(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits, y

    def training_step(self, batch, batch_idx):
        loss, logits, y = self.step(batch)
        self.train_metrics(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        self.log_dict(self.train_metrics, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, y = self.step(batch)
        self.val_metrics(logits, y)
        self.log("val/loss", loss, on_epoch=True)
        self.log_dict(self.val_metrics, on_epoch=True, prog_bar=True)

    def test_step(self, batch, batch_idx):
        loss, logits, y = self.step(batch)
        self.test_metrics(logits, y)
        self.log("test/loss", loss)
        self.log_dict(self.test_metrics)

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


# ------------------------------------------------------------------- a PyPI library's linear model


class LogisticRegression(pl.LightningModule):
    def __init__(
        self,
        input_dim: int = 64,
        num_classes: int = 10,
        bias: bool = True,
        learning_rate: float = 1e-2,
        max_learning_rate: float = 0.2,
        l1_strength: float = 0.0,
        l2_strength: float = 1e-4,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.linear = nn.Linear(
            in_features=self.hparams.input_dim, out_features=self.hparams.num_classes, bias=bias
        )

    def forward(self, x):
        return self.linear(x)

    def _loss(self, batch):
        x, y = batch
        y_hat = self.linear(x)
        loss = F.cross_entropy(y_hat, y, reduction="sum")
        if self.hparams.l1_strength > 0:
            loss += self.hparams.l1_strength * sum(param.abs().sum() for param in self.parameters())
        if self.hparams.l2_strength > 0:
            loss += self.hparams.l2_strength * sum(param.pow(2).sum() for param in self.parameters())
        return loss / x.size(0), (y_hat.argmax(dim=-1) == y).float().mean()

    def training_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, acc = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", acc, sync_dist=True)

    def test_step(self, batch, batch_idx):
        loss, acc = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_acc", acc, sync_dist=True)

    def configure_optimizers(self):
        optimizer = optim.SGD(self.parameters(), lr=self.hparams.learning_rate)
        scheduler = optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=self.hparams.max_learning_rate,
            total_steps=self.trainer.estimated_stepping_batches,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------- EMA through WeightAveraging


class EMAWeightAveraging(WeightAveraging):
    def __init__(self, decay: float = 0.9, start_step: int = 5):
        super().__init__(multi_avg_fn=get_ema_multi_avg_fn(decay))
        self.start_step = start_step

    def should_update(self, step_idx=None, epoch_idx=None):
        return step_idx is not None and step_idx >= self.start_step


class LitDigits(L.LightningDataModule):
    """DigitsData written with `import lightning as L` (a run's classes are of one Lightning package)."""

    setup, train_dataloader, val_dataloader, test_dataloader = (
        DigitsData.setup,
        DigitsData.train_dataloader,
        DigitsData.val_dataloader,
        DigitsData.test_dataloader,
    )

    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size


class EMAClassifier(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


# ------------------------------------------------------------------- the UvA tutorial's Transformer


class ReverseDataset(data.Dataset):
    def __init__(self, num_categories: int, seq_len: int, size: int):
        super().__init__()
        self.num_categories = num_categories
        self.seq_len = seq_len
        self.size = size
        self.data = torch.randint(self.num_categories, size=(self.size, self.seq_len))

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        inp_data = self.data[idx]
        labels = torch.flip(inp_data, dims=(0,))
        return inp_data, labels


class CosineWarmupScheduler(optim.lr_scheduler._LRScheduler):
    def __init__(self, optimizer, warmup, max_iters):
        self.warmup = warmup
        self.max_num_iters = max_iters
        super().__init__(optimizer)

    def get_lr(self):
        lr_factor = self.get_lr_factor(epoch=self.last_epoch)
        return [base_lr * lr_factor for base_lr in self.base_lrs]

    def get_lr_factor(self, epoch):
        lr_factor = 0.5 * (1 + np.cos(np.pi * epoch / self.max_num_iters))
        if epoch <= self.warmup:
            lr_factor *= epoch * 1.0 / self.warmup
        return lr_factor


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-np.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class TransformerPredictor(pl.LightningModule):
    def __init__(
        self,
        input_dim: int,
        model_dim: int,
        num_classes: int,
        num_heads: int,
        num_layers: int,
        lr: float,
        warmup: int,
        max_iters: int,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self._create_model()

    def _create_model(self):
        self.input_net = nn.Linear(self.hparams.input_dim, self.hparams.model_dim)
        self.positional_encoding = PositionalEncoding(d_model=self.hparams.model_dim)
        layer = nn.TransformerEncoderLayer(
            self.hparams.model_dim,
            self.hparams.num_heads,
            dim_feedforward=2 * self.hparams.model_dim,
            dropout=self.hparams.dropout,
            batch_first=True,
        )
        self.transformer = nn.TransformerEncoder(
            layer, num_layers=self.hparams.num_layers, enable_nested_tensor=False
        )
        self.output_net = nn.Sequential(
            nn.Linear(self.hparams.model_dim, self.hparams.model_dim),
            nn.LayerNorm(self.hparams.model_dim),
            nn.ReLU(inplace=True),
            nn.Linear(self.hparams.model_dim, self.hparams.num_classes),
        )

    def forward(self, x, add_positional_encoding=True):
        x = self.input_net(x)
        if add_positional_encoding:
            x = self.positional_encoding(x)
        return self.output_net(self.transformer(x))

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=self.hparams.lr)
        # stepped per iteration (the tutorial steps it in optimizer_step; given to Lightning, it resumes too)
        self.lr_scheduler = CosineWarmupScheduler(
            optimizer, warmup=self.hparams.warmup, max_iters=self.hparams.max_iters
        )
        return [optimizer], [{"scheduler": self.lr_scheduler, "interval": "step"}]


class ReversePredictor(TransformerPredictor):
    def _calculate_loss(self, batch, mode="train"):
        inp_data, labels = batch
        inp_data = F.one_hot(inp_data, num_classes=self.hparams.num_classes).float()
        preds = self.forward(inp_data, add_positional_encoding=True)
        loss = F.cross_entropy(preds.view(-1, preds.size(-1)), labels.view(-1))
        acc = (preds.argmax(dim=-1) == labels).float().mean()
        self.log(f"{mode}_loss", loss)
        self.log(f"{mode}_acc", acc)
        return loss, acc

    def training_step(self, batch, batch_idx):
        loss, _ = self._calculate_loss(batch, mode="train")
        return loss

    def validation_step(self, batch, batch_idx):
        _ = self._calculate_loss(batch, mode="val")

    def test_step(self, batch, batch_idx):
        _ = self._calculate_loss(batch, mode="test")
