"""MNIST and Fashion-MNIST from torchvision's raw files: read, refused with one sentence when missing
or corrupt, and the offline-compute-node case as a real process."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from hpctrain.data.images import DataUnavailable
from myproject.data.mnist import FashionMNISTDataModule, MNISTDataModule
from tests.helpers import train
from tests.test_train import _one_sentence_error


@pytest.mark.parametrize("cls", [MNISTDataModule, FashionMNISTDataModule])
def test_mnist_reads_torchvision_raw_files(cls, mnist_dir: Path):
    datamodule = cls(data_dir=str(mnist_dir), download=False, val_size=100, batch_size=50)
    datamodule.check_available()
    datamodule.setup()
    train, val, test = datamodule.splits
    assert (len(train), len(val), len(test)) == (5500, 100, 200)
    assert set(test.labels.tolist()) == set(range(10))


def test_missing_mnist_names_the_path_and_the_fix(tmp_path: Path):
    datamodule = MNISTDataModule(data_dir=str(tmp_path), download=False)
    with pytest.raises(DataUnavailable) as err:
        datamodule.check_available()
    message = str(err.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "scripts/prepare_data.py data=mnist" in message
    assert "\n" not in message


def test_truncated_mnist_is_reported_not_raised(tmp_path: Path, mnist_dir: Path):
    shutil.copytree(mnist_dir / "MNIST", tmp_path / "MNIST")
    images = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:5000])
    with pytest.raises(DataUnavailable) as err:
        MNISTDataModule(data_dir=str(tmp_path), download=False).check_available()
    assert "corrupt or truncated" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_missing_dataset_on_an_offline_node_is_one_sentence(tmp_path: Path):
    empty = tmp_path / "empty"
    message = _one_sentence_error(
        train(tmp_path, "data=mnist", f"paths.data_dir={empty}", "data.download=false")
    )
    assert (
        f"MNIST is not in {empty}/MNIST/raw" in message
        and "python scripts/prepare_data.py data=mnist" in message
    )


@pytest.mark.slow
def test_missing_dataset_without_internet_fails_at_once(tmp_path: Path):
    try:
        socket.create_connection(("ossci-datasets.s3.amazonaws.com", 443), timeout=3).close()
        pytest.skip("this machine can download MNIST")
    except OSError:
        pass
    message = _one_sentence_error(train(tmp_path, "data=mnist", f"paths.data_dir={tmp_path / 'empty'}"))
    assert "cannot reach its download mirrors" in message
