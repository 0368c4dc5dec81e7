"""CIFAR-10: the official python-pickle batches (torchvision's layout), held in memory as uint8, with
random-crop and horizontal-flip augmentation applied to whole batches on the device."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hpctrain.data import DownloadedImageDataModule
from hpctrain.data import TensorDataset

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
# the only objects a CIFAR batch file holds: plain containers, strings and numpy arrays
ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch file and nothing else: any other object in the file (which could run code
    while being loaded) makes the file corrupt, not dangerous."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch file")
        target = getattr(np, "_core", None) or np.core  # numpy 2 or 1
        target = target.multiarray if module.endswith("multiarray") else np
        return getattr(target, name)


def read_batch(path: Path) -> tuple[Tensor, Tensor]:
    """One batch file: uint8 images (N, 3, 32, 32) and int64 labels."""
    with open(path, "rb") as file:
        content = _BatchUnpickler(file, encoding="bytes").load()
    data, labels = np.asarray(content[b"data"], dtype=np.uint8), content[b"labels"]
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{path.name} holds {data.shape} data for {len(labels)} labels, not N x 3072")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.as_tensor(labels, dtype=torch.int64)


def random_crop_and_flip(images: Tensor, padding: int, flip: bool) -> Tensor:
    """Each image of the batch shifted by up to `padding` pixels (zero fill) and mirrored with probability
    one half: one gather for the whole batch, on its device, uint8 in and out."""
    b, c, h, w = images.shape
    if not padding and not flip:
        return images
    device = images.device
    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    width = w + 2 * padding
    rows = torch.randint(0, 2 * padding + 1, (b, 1, 1), device=device) + torch.arange(h, device=device).view(
        1, h, 1
    )
    cols = torch.arange(w, device=device).view(1, 1, w).expand(b, 1, w)
    if flip:
        cols = torch.where(torch.rand(b, 1, 1, device=device) < 0.5, (w - 1) - cols, cols)
    cols = cols + torch.randint(0, 2 * padding + 1, (b, 1, 1), device=device)
    index = (rows * width + cols).view(b, 1, h * w).expand(b, c, h * w)
    return padded.reshape(b, c, -1).gather(2, index).view(b, c, h, w)


class CIFAR10DataModule(DownloadedImageDataModule):
    """50,000 training images (split into train and `val_size` validation) and 10,000 test images."""

    name = "CIFAR-10"
    config_name = "cifar10"
    mirrors = ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",)
    default_mean = (0.4914, 0.4822, 0.4465)
    default_std = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        data_dir: str,
        download: bool = True,
        val_size: int = 5_000,
        crop_padding: int = 4,
        flip: bool = True,
        num_classes: int = 10,
        image_shape: tuple[int, ...] = (3, 32, 32),
        **image_args,
    ) -> None:
        super().__init__(
            data_dir, download, val_size, num_classes=num_classes, image_shape=image_shape, **image_args
        )
        self.crop_padding = crop_padding
        self.flip = flip

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "cifar-10-batches-py"

    def file_names(self) -> list[str]:
        return [*TRAIN_FILES, TEST_FILE]

    def fetch(self) -> None:
        from torchvision import datasets

        datasets.CIFAR10(str(self.data_dir), train=True, download=True)

    def read_files(self) -> tuple[TensorDataset, TensorDataset]:
        # read here rather than through torchvision's class, which loads the files with plain pickle
        train = [read_batch(self.files_dir / name) for name in TRAIN_FILES]
        test = read_batch(self.files_dir / TEST_FILE)
        images, labels = torch.cat([b[0] for b in train]), torch.cat([b[1] for b in train])
        return TensorDataset(images, labels), TensorDataset(*test)

    def augment(self, images: Tensor) -> Tensor:
        return random_crop_and_flip(images, self.crop_padding, self.flip)
