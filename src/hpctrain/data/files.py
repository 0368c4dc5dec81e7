"""Images read from files while training: a folder of JPEG/PNG files (`data=image_folder`), or the
shards made from one (`data=shards`, `hpctrain.data.shards`). Nothing is held in memory but an index.

The same batch path as the in-memory datamodules: the template's sampler hands a loader worker a batch
of indices, the worker decodes those files into one uint8 (B, C, H, W) tensor (`hpctrain.data.decode`:
EXIF orientation, channels, a deterministic resize), and augmentation and normalisation happen on the
device. So the guarantees carry over unchanged: a batch is a pure function of (seed, epoch, rank), the
loader's position is saved in every checkpoint, and a run resumed mid-epoch sees exactly the batches
it would have seen, whatever `data.num_workers` is.

The index is numpy arrays (paths as fixed-width bytes, labels as int64), not Python lists: forked
loader workers share its pages instead of copying each object they touch (reference counts are
writes), so the memory of a rank and its workers does not grow with the dataset.

A file that cannot be decoded comes back from the worker with the label `BAD - index` (-1 stays what it
is elsewhere: no label, as in prediction inputs); the main process turns that into one sentence naming the
file (`data.skip_bad=false`), or drops the sample and counts it.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from hpctrain.data.decode import IMAGE_SUFFIXES, UnreadableImage, decode_into
from hpctrain.data.images import ImageDataModule
from hpctrain.runtime.errors import UserError

log = logging.getLogger("hpctrain")
SPLITS = ("train", "val", "test")
BAD = -2  # a label at or below: file `BAD - label` of the batch's dataset could not be decoded


class EncodedImages(Dataset):
    """Encoded images (the bytes of a JPEG or PNG file) and their labels; `read(i)` gives file i's bytes.

    Indexed with a tensor of indices (the template's sampler), it returns the whole batch decoded."""

    def __init__(self, names: np.ndarray, labels: np.ndarray, image_shape: Sequence[int]) -> None:
        self.names = names  # fixed-width bytes: what a sentence about a bad file calls it
        self.labels = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
        self.image_shape = tuple(int(d) for d in image_shape)

    def read(self, index: int) -> bytes:
        raise NotImplementedError

    def name(self, index: int) -> str:
        return os.fsdecode(self.names[index])

    per_sample: tuple[str, ...] = ("names",)  # numpy arrays of one entry per sample, besides the labels

    def _copy(self) -> EncodedImages:
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        return copy

    def with_labels(self, labels: Tensor) -> EncodedImages:
        """The same files with other labels (`data.label_map`)."""
        copy = self._copy()
        copy.labels = labels
        return copy

    def subset(self, indices: Any) -> EncodedImages:
        """The files at `indices` (a sequence, numpy array or tensor of indices), in that order."""
        chosen = np.asarray(indices, dtype=np.int64)
        copy = self._copy()
        for name in self.per_sample:
            setattr(copy, name, getattr(self, name)[chosen])
        copy.labels = self.labels[torch.from_numpy(chosen)]
        return copy

    def joined(self, other: EncodedImages) -> EncodedImages:
        """This dataset's files followed by `other`'s (another split of the same source)."""
        copy = self._copy()
        for name in self.per_sample:
            setattr(copy, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        copy.labels = torch.cat([self.labels, other.labels])
        return copy

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Tensor | int) -> tuple[Tensor, Tensor]:
        single = not isinstance(index, Tensor) or index.dim() == 0
        indices = [int(index)] if single else index.tolist()
        images = torch.empty((len(indices), *self.image_shape), dtype=torch.uint8)
        slots = images.numpy()  # each image is decoded straight into its place in the batch
        labels = self.labels[indices].clone()
        for row, i in enumerate(indices):
            try:
                decode_into(io.BytesIO(self.read(i)), slots[row])
            except (UnreadableImage, OSError):
                labels[row] = BAD - i  # told to the main process, which names the file or skips it
        return (images[0], labels[0]) if single else (images, labels)


class FolderImages(EncodedImages):
    """Files under `root`, named by their paths relative to it."""

    def __init__(self, root: Path, names: np.ndarray, labels: np.ndarray, image_shape: Sequence[int]) -> None:
        super().__init__(names, labels, image_shape)
        self.root = os.fsencode(root)

    def read(self, index: int) -> bytes:
        with open(os.path.join(self.root, self.names[index]), "rb") as file:
            return file.read()

    def joined(self, other: EncodedImages) -> EncodedImages:
        if not isinstance(other, FolderImages) or other.root != self.root:
            raise ValueError("only splits of the same image folder can be joined")
        return super().joined(other)


class FileImageDataModule(ImageDataModule):
    """The base of datamodules whose images are files decoded in loader workers.

    `skip_bad`: false (default) stops at the first file that cannot be read, with one sentence naming
    it; true drops such files and counts them (`skipped_files`, in the log and outcome.yaml).
    `stage_dir`: where a node-local copy goes (only `data=shards` can stage; others refuse it).
    """

    can_stage = False
    decodes_files = True  # data.num_workers=auto gives it loader workers

    def __init__(
        self, *args: Any, skip_bad: bool = False, stage_dir: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.skip_bad = bool(skip_bad)
        self.stage_dir = stage_dir or None
        self.skipped_files = 0
        if self.stage_dir and not self.can_stage:
            raise UserError(
                f"data.stage_dir={self.stage_dir}: {type(self).__name__} reads its files where they are; make "
                "shards of them (python scripts/make_shards.py ...) and train with data=shards to stage them."
            )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        bad = labels <= BAD  # on the host: no device sync
        if not bool(bad.any()):
            return batch
        source = self._dataset_of(dataloader_idx)
        names = [source.name(BAD - int(i)) for i in labels[bad]]
        if not self.skip_bad:
            raise UserError(
                f"{names[0]} cannot be read as an image; remove or replace it, or pass data.skip_bad=true to "
                "skip unreadable files."
            )
        self.skipped_files += len(names)
        for name in names:
            log.warning("skipped %s: it cannot be read as an image (data.skip_bad=true)", name)
        keep = ~bad
        return images[keep], labels[keep]

    def _dataset_of(self, dataloader_idx: int) -> EncodedImages:
        """The files behind the batch: the dataset of the loader the trainer is running."""
        assert self.splits is not None
        trainer = self.trainer
        if trainer is None:
            return self.splits[0]
        if trainer.training:
            loaders = trainer.train_dataloader
        elif trainer.testing:
            loaders = trainer.test_dataloaders
        elif trainer.predicting:
            loaders = trainer.predict_dataloaders
        else:
            loaders = trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[dataloader_idx]
        dataset = getattr(loaders, "dataset", None)
        return dataset if isinstance(dataset, EncodedImages) else self.splits[0]


def list_split(folder: Path, classes: Sequence[str], skip_bad: bool) -> tuple[list[bytes], list[int], int]:
    """The image files of one split folder, `<folder>/<class>/<file>`: their paths relative to the folder's
    parent, their class indices, and how many files were skipped (not images; with `skip_bad`)."""
    names: list[bytes] = []
    labels: list[int] = []
    skipped = 0
    index = {name: i for i, name in enumerate(classes)}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue  # .DS_Store and friends
        if not entry.is_dir():
            if not skip_bad:
                raise UserError(
                    f"{entry.path} is not in a class folder; the layout is <root>/{folder.name}/<class>/<image> "
                    "(or pass data.skip_bad=true to skip such files)."
                )
            skipped += 1
            continue
        if entry.name not in index:
            raise UserError(
                f"{entry.path} is a class that {folder.parent / 'train'} does not have; every split needs the "
                "training split's class folders (or a subset of them)."
            )
        found = 0
        for file in sorted(os.scandir(entry.path), key=lambda e: e.name):
            if file.name.startswith("."):
                continue
            if not (file.is_file() and Path(file.name).suffix.lower() in IMAGE_SUFFIXES):
                if not skip_bad:
                    raise UserError(
                        f"{file.path} is not a .png, .jpg or .jpeg file; remove it, or pass data.skip_bad=true "
                        "to skip files that are not images."
                    )
                skipped += 1
                continue
            names.append(os.fsencode(os.path.join(folder.name, entry.name, file.name)))
            labels.append(index[entry.name])
            found += 1
        if not found and not skip_bad:
            raise UserError(
                f"class folder {entry.path} holds no images; remove it or add its images (or pass "
                "data.skip_bad=true to train without them)."
            )
    return names, labels, skipped


def read_classes(root: Path) -> list[str]:
    """The class names: the training split's sub-folders, sorted (as torchvision's ImageFolder)."""
    train = root / "train"
    if not train.is_dir():
        raise UserError(
            f"data.root={root} has no train/ folder; the layout is <root>/train/<class>/<image> "
            "(and val/, optionally test/, alike)."
        )
    classes = sorted(e.name for e in os.scandir(train) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{train} holds no class folders; the layout is <root>/train/<class>/<image>.")
    return classes


def as_index(names: list[bytes], labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The file list as numpy arrays (shared by forked workers, page for page, without copies)."""
    return np.array(names, dtype=np.bytes_) if names else np.array([], dtype="S1"), np.array(
        labels, dtype=np.int64
    )


class ImageFolderDataModule(FileImageDataModule):
    """`<root>/{train,val[,test]}/<class>/<image>` (JPEG, PNG), classes from the sorted folder names of
    train/; val/ and test/ may hold a subset of them. Without test/, the run has no test split."""

    def __init__(self, root: str, num_classes: int, image_shape: Sequence[int], **kwargs: Any) -> None:
        super().__init__(num_classes=num_classes, image_shape=image_shape, **kwargs)
        self.root = Path(root)
        self.classes: list[str] = []

    @property
    def has_test(self) -> bool:
        return (self.root / "test").is_dir()

    def check_available(self) -> None:
        if not self.root.is_dir():
            raise UserError(
                f"data.root={self.root} is not a folder; pass the folder that holds train/ and val/."
            )
        self.classes = read_classes(self.root)
        if len(self.classes) != self.num_classes:
            raise UserError(
                f"data.num_classes={self.num_classes} but {self.root / 'train'} has {len(self.classes)} class "
                f"folders; pass data.num_classes={len(self.classes)}."
            )
        if not (self.root / "val").is_dir():
            raise UserError(
                f"data.root={self.root} has no val/ folder; the layout is <root>/val/<class>/<image>."
            )

    def load(self) -> tuple[FolderImages, ...]:
        self.check_available()
        parts = []
        for split in SPLITS:
            folder = self.root / split
            names, labels, skipped = (
                list_split(folder, self.classes, self.skip_bad) if folder.is_dir() else ([], [], 0)
            )
            self.skipped_files += skipped
            parts.append(FolderImages(self.root, *as_index(names, labels), self.image_shape))
        if self.skipped_files:
            log.warning("data.skip_bad=true: skipped %d files that are not images", self.skipped_files)
        return tuple(parts)
