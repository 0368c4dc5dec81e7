"""A user's code whose batches are not `(inputs, targets)`: three datamodules and the LightningModule that
trains on each, written as Lightning's documentation writes them (nothing here knows the template).

tests/test_users_configs.py copies this file into a copy of the project (src/myproject/batch_shapes.py)
with a data, model and experiment config for each pair, and runs the template's tests that iterate conf/
there:

- `PointsDataModule`: unsupervised, batches `(x,)`; `PointsAutoEncoder` reconstructs them;
- `TwoViewsDataModule`: two inputs, batches `((x1, x2), y)`; `TwoViewsClassifier`;
- `LabelledImagesDataModule`: dict batches `{"image": ..., "label": ...}`; `LabelledImagesClassifier`.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _SplitData(pl.LightningDataModule):
    """Train, val and test splits of one in-memory dataset, made by `make(n, seed)` in setup."""

    sizes = {"train": 96, "val": 32, "test": 32}

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def make(self, n: int, seed: int) -> Dataset:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        self.splits = {name: self.make(n, seed) for seed, (name, n) in enumerate(self.sizes.items())}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size)


class _Steps(pl.LightningModule):
    """training/validation/test steps from `loss_and_accuracy(batch)`; Adam at `lr`."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr

    def loss_and_accuracy(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _step(self, batch, stage: str) -> torch.Tensor:
        loss, accuracy = self.loss_and_accuracy(batch)
        self.log(f"{stage}/loss", loss, sync_dist=stage != "train")
        if accuracy is not None:
            self.log(f"{stage}/acc", accuracy, sync_dist=stage != "train")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == labels).float().mean()


# ------------------------------------------------------------------------------ unsupervised: (x,)


class PointsDataModule(_SplitData):
    """Points near a line in `dim` dimensions, no labels: each batch is `(x,)`."""

    def __init__(self, dim: int = 8, batch_size: int = 16) -> None:
        super().__init__(batch_size)
        self.dim = dim

    def make(self, n: int, seed: int) -> Dataset:
        g = _generator(seed)
        t = torch.randn(n, 1, generator=g)
        return TensorDataset(
            t * torch.linspace(-1, 1, self.dim) + 0.05 * torch.randn(n, self.dim, generator=g)
        )


class PointsAutoEncoder(_Steps):
    def __init__(self, dim: int, code: int = 2, lr: float = 0.01) -> None:
        super().__init__(lr)
        self.save_hyperparameters()
        self.encoder, self.decoder = nn.Linear(dim, code), nn.Linear(code, dim)

    def loss_and_accuracy(self, batch):
        (x,) = batch
        return F.mse_loss(self.decoder(self.encoder(x)), x), None


# --------------------------------------------------------------------- several inputs: ((x1, x2), y)


class _TwoViews(Dataset):
    def __init__(self, n: int, dim: int, num_classes: int, seed: int) -> None:
        g = _generator(seed)
        self.x1, self.x2 = torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g)
        self.y = ((self.x1[:, 0] + self.x2[:, 0]).sign().long() + 1).clamp(max=num_classes - 1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return (self.x1[i], self.x2[i]), self.y[i]


class TwoViewsDataModule(_SplitData):
    """Two views of each sample and a class: each batch is `((x1, x2), y)`."""

    def __init__(self, dim: int = 8, num_classes: int = 3, batch_size: int = 16) -> None:
        super().__init__(batch_size)
        self.dim, self.num_classes = dim, num_classes

    def make(self, n: int, seed: int) -> Dataset:
        return _TwoViews(n, self.dim, self.num_classes, seed)


class TwoViewsClassifier(_Steps):
    def __init__(self, dim: int, num_classes: int, lr: float = 0.01) -> None:
        super().__init__(lr)
        self.save_hyperparameters()
        self.first, self.second = nn.Linear(dim, num_classes), nn.Linear(dim, num_classes)

    def loss_and_accuracy(self, batch):
        (x1, x2), y = batch
        logits = self.first(x1) + self.second(x2)
        return F.cross_entropy(logits, y), _accuracy(logits, y)


# --------------------------------------------------------------- dict batches: {"image", "label"}


class _LabelledImages(Dataset):
    def __init__(self, n: int, image_shape: list[int], num_classes: int, seed: int) -> None:
        g = _generator(seed)
        self.labels = torch.randint(num_classes, (n,), generator=g)
        self.images = torch.randn(n, *image_shape, generator=g) + self.labels.view(-1, 1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "label": self.labels[i]}


class LabelledImagesDataModule(_SplitData):
    """Images and their classes as a dict, as Hugging Face datasets give them: `{"image", "label"}`."""

    def __init__(
        self, num_classes: int = 4, image_shape: list[int] | None = None, batch_size: int = 16
    ) -> None:
        super().__init__(batch_size)
        self.num_classes, self.image_shape = num_classes, list(image_shape or [1, 8, 8])

    def make(self, n: int, seed: int) -> Dataset:
        return _LabelledImages(n, self.image_shape, self.num_classes, seed)


class LabelledImagesClassifier(_Steps):
    def __init__(self, num_classes: int, image_shape: list[int], lr: float = 0.01) -> None:
        super().__init__(lr)
        self.save_hyperparameters()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(image_shape).prod()), num_classes))

    def loss_and_accuracy(self, batch):
        logits = self.head(batch["image"])
        return F.cross_entropy(logits, batch["label"]), _accuracy(logits, batch["label"])
