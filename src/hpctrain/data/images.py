"""The base of the image datamodules here: uint8 images held in memory, augmented and normalised per
batch on the device."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hpctrain.data.kfold import check_folds, folds
from hpctrain.data.loading import (
    ResumableDataLoader,
    TensorDataset,
    make_loader,
    pin_memory_default,
    tensors_to_device,
)
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

log = logging.getLogger("hpctrain")


class DataUnavailable(UserError):
    """The dataset is missing, corrupt or cannot be downloaded."""


def split(dataset: TensorDataset, holdout: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Split off `holdout` samples with a fixed generator, so the split does not depend on `seed`."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    keep, held = order[holdout:], order[:holdout]
    return TensorDataset(*dataset[keep]), TensorDataset(*dataset[held])


class ImageDataModule(LightningPart, lightning="pytorch_lightning.LightningDataModule"):
    """Subclasses implement `load` (and, if they read files, `check_available` and `prepare_data`).

    Images stay uint8 (N, C, H, W) on the host, are indexed a batch at a time, and become normalised
    float only after the transfer to the device: 4x less host-to-device traffic and no per-sample
    Python work. Training batches pass through `augment` first (uint8, on the device). `batch_size`
    is per process (per GPU), as in Lightning.

    `label_map` (optional) gives each class a new label: `[0, 1, 0, 1, ...]` with `num_classes: 2` turns
    digits into odd-or-even, a changed task on the same images (experiment=finetune_digits).

    `num_folds` and `fold` (optional): k-fold cross-validation. What `load` returns as train and val, taken
    together, is the training data; it is dealt into `num_folds` folds, stratified by class
    (`hpctrain.data.folds`, deterministic given `fold_seed`, which is not the run's seed: runs with other
    seeds share the folds); fold `fold` is the validation set, the others the training set. The test
    split stays as it is. Without `num_folds` (null or 0), `load`'s own split, unchanged.

    `num_classes` and `image_shape` are what models read from the config (`${data.num_classes}`); they
    are checked against the loaded data, so a model can never be built for the wrong sizes. `mean` and
    `std` (per channel, of pixels in [0, 1]) default to the dataset's own (`default_mean`, `default_std`).

    A LightningDataModule of the Lightning package the run's model is written with (`import lightning as L`
    or `import pytorch_lightning as pl`), made so when constructed (`hpctrain.runtime.namespaces`); outside
    a run, pytorch_lightning's.
    """

    default_mean: tuple[float, ...] = (0.5,)
    default_std: tuple[float, ...] = (0.5,)

    def __init__(
        self,
        num_classes: int,
        image_shape: Sequence[int],
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 0,
        label_map: Sequence[int] | None = None,
        num_folds: int | None = None,
        fold: int | None = None,
        fold_seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_folds = check_folds(num_folds, fold)
        self.fold = fold
        self.fold_seed = fold_seed
        self.num_classes = int(num_classes)
        self.image_shape = tuple(int(d) for d in image_shape)
        self.mean = tuple(float(m) for m in (self.default_mean if mean is None else mean))
        self.std = tuple(float(s) for s in (self.default_std if std is None else std))
        if len(self.mean) not in (1, self.image_shape[0]) or len(self.std) != len(self.mean):
            raise UserError(
                f"data.mean={list(self.mean)} and data.std={list(self.std)} need one value, or one per channel "
                f"of data.image_shape={list(self.image_shape)}; pass lists of {self.image_shape[0]} values."
            )
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.label_map = None if label_map is None else torch.tensor([int(c) for c in label_map])
        self.splits: tuple[TensorDataset, TensorDataset, TensorDataset] | None = None
        self._normalisers: dict[torch.device, Normalise] = {}

    def load(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        """Return (train, val, test) datasets of uint8 images (N, C, H, W) and int64 labels."""
        raise NotImplementedError

    def augment(self, images: Tensor) -> Tensor:
        """Augment a training batch: uint8 (B, C, H, W) on the device, before normalisation.

        Only training batches come here. Draw randomness from torch's default generator (on the batch's
        device): checkpoints store its state, so a resumed run draws the same augmentations.
        """
        return images

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            splits = self.load()
            if self.num_folds is not None:
                splits = self._folded(splits)
            if self.label_map is not None:
                splits = tuple(self._relabelled(part) for part in splits)
            self._check_sizes(splits)
            self.splits = splits

    def _folded(self, splits: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        """(training folds, validation fold, test): `load`'s train and val, dealt into folds."""
        train, val, test = splits
        everything = train.joined(val)
        keep, held = folds(everything.labels, self.num_folds, self.fold, self.fold_seed)  # type: ignore[arg-type]
        if self.trainer is None or self.trainer.is_global_zero:
            log.info(
                "k-fold: fold %d of %d (data.fold_seed=%d) validates on %d of the %d training samples and "
                "trains on the other %d, stratified by class; the test split (%d) is unchanged",
                self.fold,
                self.num_folds,
                self.fold_seed,
                len(held),
                len(everything),
                len(keep),
                len(test),
            )
        return everything.subset(keep), everything.subset(held), test

    def _relabelled(self, part: TensorDataset) -> TensorDataset:
        """`label_map[c]` in place of every label c: a new task on the same images (classes merged)."""
        assert self.label_map is not None
        if len(part) and int(part.labels.max()) >= len(self.label_map):
            raise UserError(
                f"data.label_map has {len(self.label_map)} entries but {type(self).__name__} has label "
                f"{int(part.labels.max())}; give one new label per class."
            )
        return part.with_labels(self.label_map[part.labels])

    def _check_sizes(self, splits: tuple[TensorDataset, ...]) -> None:
        name = type(self).__name__
        for part in splits:
            shape = part.image_shape  # files are decoded into the configured shape; tensors have their own
            if shape != self.image_shape:
                raise UserError(
                    f"data.image_shape={list(self.image_shape)} but {name} holds {'x'.join(map(str, shape))} "
                    f"images; pass data.image_shape={list(shape)}."
                )
            if len(part) and int(part.labels.max()) >= self.num_classes:
                raise UserError(
                    f"data.num_classes={self.num_classes} but {name} has label {int(part.labels.max())}; "
                    f"pass data.num_classes={int(part.labels.max()) + 1}."
                )

    def _loader(self, index: int, shuffle: bool) -> ResumableDataLoader:
        if self.splits is None:
            self.setup()
        assert self.splits is not None
        return make_loader(
            self.splits[index],
            self.batch_size,
            shuffle=shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            pin_memory=pin_memory_default(self.pin_memory, self.trainer),
            split=("train", "val", "test")[index],
        )

    def train_dataloader(self) -> ResumableDataLoader:
        return self._loader(0, shuffle=True)

    def val_dataloader(self) -> ResumableDataLoader:
        return self._loader(1, shuffle=False)

    def test_dataloader(self) -> ResumableDataLoader:
        return self._loader(2, shuffle=False)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        moved = tensors_to_device(batch, device)
        return moved if moved is not None else super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(
        self, batch: tuple[Tensor, Tensor], dataloader_idx: int
    ) -> tuple[Tensor, Tensor]:
        images, labels = batch
        if images.dtype != torch.uint8:
            return images, labels
        trainer = self.trainer
        if trainer is not None and trainer.training:
            images = self.augment(images)
        images = self.normalise(images)
        if trainer is not None:
            # Lightning converts the input dtype before this hook, while the batch is still uint8; a
            # `*-true` precision (bf16-true, 16-true, 64-true) needs the float images converted now.
            images = trainer.precision_plugin.convert_input(images)
        return images, labels

    def normalise(self, images: Tensor) -> Tensor:
        """uint8 images -> float32, (x / 255 - mean) / std per channel (`Normalise`, one per device)."""
        normaliser = self._normalisers.get(images.device)
        if normaliser is None:
            normaliser = self._normalisers[images.device] = self.preprocessing().to(images.device)
        return normaliser(images)

    def preprocessing(self) -> Normalise:
        """What a model trained on this data expects in front of it: `hpctrain.load` and the exported
        models carry it, so they take the same uint8 images as this datamodule's batches."""
        return Normalise(self.mean, self.std)


class Normalise(nn.Module):
    """uint8 images (B, C, H, W) -> float32 (x / 255 - mean) / std per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        shape = (1, -1, 1, 1)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.register_buffer("offset", torch.tensor(self.mean).mul_(255.0).view(shape), persistent=False)
        self.register_buffer(
            "scale", torch.tensor(self.std).mul_(255.0).reciprocal_().view(shape), persistent=False
        )

    def forward(self, images: Tensor) -> Tensor:
        return (images.float() - self.offset) * self.scale

    def extra_repr(self) -> str:
        return f"mean={list(self.mean)}, std={list(self.std)}"
