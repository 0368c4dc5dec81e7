"""MNIST and Fashion-MNIST, read by torchvision from its raw files and kept as uint8 tensors."""

from __future__ import annotations

from pathlib import Path

from torchvision import datasets

from hpctrain.data import DownloadedImageDataModule
from hpctrain.data import TensorDataset


class MNISTDataModule(DownloadedImageDataModule):
    """60,000 training images (split into train and `val_size` validation) and 10,000 test images."""

    dataset_class: type[datasets.MNIST] = datasets.MNIST
    config_name = "mnist"
    default_mean = (0.1307,)
    default_std = (0.3081,)

    def __init__(
        self,
        data_dir: str,
        download: bool = True,
        val_size: int = 5_000,
        num_classes: int = 10,
        image_shape: tuple[int, ...] = (1, 28, 28),
        **image_args,
    ) -> None:
        super().__init__(
            data_dir, download, val_size, num_classes=num_classes, image_shape=image_shape, **image_args
        )
        self.name = self.dataset_class.__name__
        self.mirrors = self.dataset_class.mirrors

    @property
    def files_dir(self) -> Path:
        return self.data_dir / self.name / "raw"

    def file_names(self) -> list[str]:
        return [Path(url).with_suffix("").name for url, _ in self.dataset_class.resources]

    def fetch(self) -> None:
        for train in (True, False):
            self.dataset_class(str(self.data_dir), train=train, download=True)

    def read_files(self) -> tuple[TensorDataset, TensorDataset]:
        parts = []
        for train in (True, False):
            dataset = self.dataset_class(str(self.data_dir), train=train, download=False)
            parts.append(TensorDataset(dataset.data.unsqueeze(1), dataset.targets.long()))
        return parts[0], parts[1]


class FashionMNISTDataModule(MNISTDataModule):
    """Zalando's Fashion-MNIST: the same format and sizes as MNIST, ten kinds of clothing."""

    dataset_class = datasets.FashionMNIST
    config_name = "fashion_mnist"
    default_mean = (0.2860,)
    default_std = (0.3530,)
