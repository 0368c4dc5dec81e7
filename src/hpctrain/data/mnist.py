"""MNIST and Fashion-MNIST, read by torchvision from its raw files and kept as uint8 tensors.

Compute nodes are often offline, so availability is checked on every rank before any process
group exists: a missing or corrupt file is one sentence naming the path and the fix, not a stack
trace or a download that hangs. `python scripts/prepare_data.py data=mnist` fetches the files on a
machine with internet access.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from torchvision import datasets

from hpctrain.data.images import DataUnavailable, ImageDataModule, split
from hpctrain.data.loading import TensorDataset

DOWNLOAD_TIMEOUT_S = 30


@contextmanager
def _socket_timeout(seconds: float):
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


class MNISTDataModule(ImageDataModule):
    """60,000 training images (split into train and `val_size` validation) and 10,000 test images."""

    dataset_class: type[datasets.MNIST] = datasets.MNIST
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
        super().__init__(num_classes=num_classes, image_shape=image_shape, **image_args)
        self.data_dir = Path(data_dir)
        self.download = download
        self.val_size = val_size
        self._loaded: tuple[TensorDataset, TensorDataset] | None = None

    @property
    def name(self) -> str:
        return self.dataset_class.__name__

    @property
    def raw_dir(self) -> Path:
        return self.data_dir / self.name / "raw"

    @property
    def fix(self) -> str:
        command = "mnist" if self.dataset_class is datasets.MNIST else "fashion_mnist"
        return (
            f"run `python scripts/prepare_data.py data={command}` on a machine with internet access "
            f"(and copy {self.data_dir} here), or set paths.data_dir to a directory that holds {self.name}/raw"
        )

    def _files_present(self) -> bool:
        return all(
            (self.raw_dir / Path(url).with_suffix("").name).is_file() for url, _ in self.dataset_class.resources
        )

    def _mirror_reachable(self) -> str | None:
        """The first mirror host that accepts a connection, or None when this machine is offline."""
        for mirror in self.dataset_class.mirrors:
            url = urlparse(mirror)
            try:
                socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
                return url.hostname
            except OSError:
                continue
        return None

    def check_available(self) -> None:
        if self._files_present():
            self._read()  # also catches corrupt and truncated files, before any process group
            return
        if not self.download:
            raise DataUnavailable(f"{self.name} is not in {self.raw_dir} and data.download=false; {self.fix}.")
        if self._mirror_reachable() is None:
            hosts = ", ".join(urlparse(m).hostname or m for m in self.dataset_class.mirrors)
            raise DataUnavailable(
                f"{self.name} is not in {self.raw_dir} and this machine cannot reach its download mirrors "
                f"({hosts}), as on an offline compute node; {self.fix}."
            )

    def prepare_data(self) -> None:
        """Download once per node (Lightning calls this on local rank 0 only)."""
        if self._files_present():
            return
        if not self.download:
            raise DataUnavailable(f"{self.name} is not in {self.raw_dir} and data.download=false; {self.fix}.")
        try:
            with _socket_timeout(DOWNLOAD_TIMEOUT_S):
                for train in (True, False):
                    self.dataset_class(str(self.data_dir), train=train, download=True)
        except Exception as err:
            reason = " ".join(str(err).split())[:300]
            raise DataUnavailable(f"downloading {self.name} into {self.raw_dir} failed ({reason}); {self.fix}.") from err

    def _read(self) -> tuple[TensorDataset, TensorDataset]:
        if self._loaded is None:
            parts = []
            for train in (True, False):
                try:
                    dataset = self.dataset_class(str(self.data_dir), train=train, download=False)
                except Exception as err:
                    reason = " ".join(str(err).split())[:300]
                    raise DataUnavailable(
                        f"{self.name} in {self.raw_dir} is missing, corrupt or truncated ({type(err).__name__}: "
                        f"{reason}); delete the directory and {self.fix}."
                    ) from err
                parts.append(TensorDataset(dataset.data.unsqueeze(1), dataset.targets.long()))
            self._loaded = (parts[0], parts[1])
        return self._loaded

    def load(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        train_and_val, test = self._read()
        if not 0 < self.val_size < len(train_and_val):
            raise DataUnavailable(
                f"data.val_size={self.val_size} must be between 0 and the {len(train_and_val)} training images "
                f"in {self.raw_dir}; pass e.g. data.val_size={len(train_and_val) // 10}."
            )
        train, val = split(train_and_val, self.val_size)
        return train, val, test


class FashionMNISTDataModule(MNISTDataModule):
    """Zalando's Fashion-MNIST: the same format and sizes as MNIST, ten kinds of clothing."""

    dataset_class = datasets.FashionMNIST
    default_mean = (0.2860,)
    default_std = (0.3530,)
