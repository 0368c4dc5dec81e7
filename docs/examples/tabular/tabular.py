"""Rows of features and a class label per row, from a .npz file (x, y, x_test, y_test)."""

import numpy as np
import torch
from pytorch_lightning import LightningDataModule

from hpctrain.data import ResumableDataLoader, TensorDataset, check_folds, folds, make_loader


class TabularDataModule(LightningDataModule):
    def __init__(
        self,
        path: str,
        batch_size: int = 256,
        val_fraction: float = 0.1,
        num_folds: int | None = None,
        fold: int | None = None,
        fold_seed: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_folds = check_folds(num_folds, fold)  # a bad pair is one sentence, before anything loads
        self.path, self.batch_size, self.val_fraction = path, batch_size, val_fraction
        self.fold, self.fold_seed, self.seed = fold, fold_seed, seed

    def setup(self, stage: str | None = None) -> None:
        data = np.load(self.path)  # x, y, x_test, y_test
        x, y = torch.as_tensor(data["x"], dtype=torch.float32), torch.as_tensor(data["y"])
        if self.num_folds is None:  # the usual split: the last val_fraction of the rows
            cut = len(y) - round(len(y) * self.val_fraction)
            train, val = np.arange(cut), np.arange(cut, len(y))
        else:  # fold `fold` of `num_folds`, stratified by label, the same for every seed
            train, val = folds(data["y"], self.num_folds, self.fold, seed=self.fold_seed)
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])
        x_test = torch.as_tensor(data["x_test"], dtype=torch.float32)
        self.test_set = TensorDataset(x_test, torch.as_tensor(data["y_test"]))  # never folded

    def train_dataloader(self) -> ResumableDataLoader:
        return make_loader(self.train_set, self.batch_size, shuffle=True, seed=self.seed)

    def val_dataloader(self) -> ResumableDataLoader:
        return make_loader(self.val_set, self.batch_size, shuffle=False, seed=self.seed, split="val")

    def test_dataloader(self) -> ResumableDataLoader:
        return make_loader(self.test_set, self.batch_size, shuffle=False, seed=self.seed, split="test")
