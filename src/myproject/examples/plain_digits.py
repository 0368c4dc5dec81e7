"""Case (c): a plain LightningDataModule over ordinary DataLoaders, written as Lightning's documentation
writes one (no template base class). Lightning adds its DistributedSampler under DDP.

It serves scikit-learn's bundled digits (offline) as float 1x28x28 images. The config's `num_classes`
and `image_shape` are the sizes models read (`${data.num_classes}`); they are checked against the data.
"""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split


class PlainDigitsDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 64, num_classes: int = 10, image_shape: tuple = (1, 28, 28)) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.image_shape = tuple(image_shape)

    def setup(self, stage=None):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        images = F.pad(F.interpolate(images, size=(20, 20), mode="bilinear"), (4, 4, 4, 4))
        images = (images - 0.13) / 0.29
        labels = torch.as_tensor(digits.target)
        assert tuple(images.shape[1:]) == self.image_shape and int(labels.max()) < self.num_classes
        self.train_set, self.val_set, self.test_set = random_split(
            TensorDataset(images, labels), [1257, 180, 360], generator=torch.Generator().manual_seed(0)
        )

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)
