"""Image datasets read from files that are downloaded once (MNIST, Fashion-MNIST, CIFAR-10).

Compute nodes are often offline, so availability is checked on every rank before any process group
exists: missing, unreadable or corrupt files are one sentence naming the path and the fix, never a
stack trace or a download that hangs. `python scripts/prepare_data.py data=<name>` fetches the files on
a machine with internet access. A subclass says where its files are, how to fetch and how to read them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from hpctrain.data.images import DataUnavailable, ImageDataModule, split
from hpctrain.data.loading import TensorDataset

DOWNLOAD_TIMEOUT_S = 30


@contextmanager
def socket_timeout(seconds: float) -> Iterator[None]:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


class DownloadedImageDataModule(ImageDataModule):
    """A training set (split into train and `val_size` validation images) and a test set, from files."""

    name: str = ""  # as users know it: MNIST, CIFAR-10
    config_name: str = ""  # its conf/data option, for the fix
    mirrors: Sequence[str] = ()  # download URLs; their hosts are probed to tell an offline machine

    def __init__(self, data_dir: str, download: bool = True, val_size: int = 5_000, **image_args) -> None:
        super().__init__(**image_args)
        self.data_dir = Path(data_dir)
        self.download = download
        self.val_size = val_size
        self._loaded: tuple[TensorDataset, TensorDataset] | None = None

    # ---- what a subclass provides
    @property
    def files_dir(self) -> Path:
        """The directory holding the dataset's files."""
        raise NotImplementedError

    def file_names(self) -> list[str]:
        raise NotImplementedError

    def fetch(self) -> None:
        """Download the files into files_dir."""
        raise NotImplementedError

    def read_files(self) -> tuple[TensorDataset, TensorDataset]:
        """(training set, test set) as uint8 images and int64 labels."""
        raise NotImplementedError

    # ---- the shared behaviour
    @property
    def fix(self) -> str:
        holds = self.files_dir.relative_to(self.data_dir)
        return (
            f"run `python scripts/prepare_data.py data={self.config_name}` on a machine with internet access "
            f"(and copy {self.data_dir} here), or set paths.data_dir to a directory that holds {holds}"
        )

    def _files_present(self) -> bool:
        try:
            return all((self.files_dir / name).is_file() for name in self.file_names())
        except PermissionError as err:
            raise DataUnavailable(
                f"cannot read {self.files_dir} ({err.strerror}); make it readable for this user, or set "
                f"paths.data_dir to a readable directory that holds {self.files_dir.relative_to(self.data_dir)}."
            ) from err

    def _mirror_reachable(self) -> str | None:
        """The first mirror host that accepts a connection, or None when this machine is offline."""
        for mirror in self.mirrors:
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
            raise DataUnavailable(
                f"{self.name} is not in {self.files_dir} and data.download=false; {self.fix}."
            )
        if self._mirror_reachable() is None:
            hosts = ", ".join(dict.fromkeys(urlparse(m).hostname or m for m in self.mirrors))
            raise DataUnavailable(
                f"{self.name} is not in {self.files_dir} and this machine cannot reach its download mirrors "
                f"({hosts}), as on an offline compute node; {self.fix}."
            )

    def prepare_data(self) -> None:
        """Download once per node (Lightning calls this on local rank 0 only)."""
        if self._files_present():
            return
        if not self.download:
            raise DataUnavailable(
                f"{self.name} is not in {self.files_dir} and data.download=false; {self.fix}."
            )
        try:
            with socket_timeout(DOWNLOAD_TIMEOUT_S):
                self.fetch()
        except Exception as err:
            reason = " ".join(str(err).split())[:300]
            raise DataUnavailable(
                f"downloading {self.name} into {self.files_dir} failed ({reason}); {self.fix}."
            ) from err

    def _read(self) -> tuple[TensorDataset, TensorDataset]:
        if self._loaded is None:
            try:
                self._loaded = self.read_files()
            except DataUnavailable:
                raise
            except Exception as err:
                reason = " ".join(str(err).split())[:300]
                raise DataUnavailable(
                    f"{self.name} in {self.files_dir} is missing, corrupt or truncated ({type(err).__name__}: "
                    f"{reason}); delete the directory and {self.fix}."
                ) from err
        return self._loaded

    def load(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        train_and_val, test = self._read()
        if not 0 < self.val_size < len(train_and_val):
            raise DataUnavailable(
                f"data.val_size={self.val_size} must be between 0 and the {len(train_and_val)} training images "
                f"in {self.files_dir}; pass e.g. data.val_size={len(train_and_val) // 10}."
            )
        train, val = split(train_and_val, self.val_size)
        return train, val, test
