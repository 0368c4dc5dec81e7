"""Datamodules and the sampler/loader: sharding, exact eval counts, mid-epoch resume, clear data errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.data.digits import DigitsDataModule
from hpctrain.data.images import DataUnavailable
from hpctrain.data.loading import ShardedBatchSampler, TensorDataset, make_loader
from hpctrain.data.mnist import FashionMNISTDataModule, MNISTDataModule


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n).view(n, 1, 1, 1).to(torch.uint8), torch.arange(n))


def _shard(n: int, world: int, rank: int, shuffle: bool, epoch: int = 0, batch_size: int = 4) -> list[int]:
    sampler = ShardedBatchSampler(
        _dataset(n), batch_size, shuffle=shuffle, seed=7, num_replicas=world, rank=rank
    )
    sampler.set_epoch(epoch)
    return [int(i) for batch in sampler for i in batch]


@pytest.mark.parametrize("n", [10, 11, 359])
def test_eval_shards_count_every_sample_exactly_once(n: int):
    shards = [_shard(n, 2, rank, shuffle=False) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(n))


@pytest.mark.parametrize("n", [10, 11, 359])
def test_train_shards_are_equal_length_and_cover_everything(n: int):
    shards = [_shard(n, 2, rank, shuffle=True) for rank in range(2)]
    assert len(shards[0]) == len(shards[1])  # equal steps on every rank, or DDP would hang
    assert set(shards[0]) | set(shards[1]) == set(range(n))


def test_shuffle_depends_on_epoch_and_is_reproducible():
    assert _shard(50, 1, 0, True, epoch=0) == _shard(50, 1, 0, True, epoch=0)
    assert _shard(50, 1, 0, True, epoch=0) != _shard(50, 1, 0, True, epoch=1)


def test_loader_resumes_mid_epoch_with_the_same_batches():
    data = _dataset(40)
    reference = make_loader(data, 4, shuffle=True, seed=3)
    reference.sampler.set_epoch(2)
    expected = [b[1].tolist() for b in reference]

    first = make_loader(data, 4, shuffle=True, seed=3)
    first.sampler.set_epoch(2)
    iterator = iter(first)
    seen = [next(iterator)[1].tolist() for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 2, "batches": 3}

    resumed = make_loader(data, 4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    rest = [b[1].tolist() for b in resumed]
    assert seen + rest == expected
    # the next epoch starts from its beginning again
    resumed.sampler.set_epoch(3)
    assert len(list(resumed)) == len(resumed) == 10


def test_saved_position_of_another_epoch_is_not_applied():
    loader = make_loader(_dataset(40), 4, shuffle=True, seed=3)
    loader.load_state_dict({"epoch": 0, "batches": 10})  # saved at the end of epoch 0
    loader.sampler.set_epoch(1)
    assert len(list(loader)) == 10


def test_digits_look_like_mnist():
    datamodule = DigitsDataModule(batch_size=32)
    datamodule.setup()
    train, val, test = datamodule.splits
    assert len(train) + len(val) + len(test) == 1797
    assert train.images.shape[1:] == (1, 28, 28) and train.images.dtype == torch.uint8
    assert train.images[:, :, :4].max() == 0  # a 4-pixel empty border, as in MNIST
    images, _ = datamodule.on_after_batch_transfer(next(iter(datamodule.train_dataloader())), 0)
    assert images.dtype == torch.float32 and abs(float(images.mean())) < 0.5


@pytest.mark.parametrize("cls", [MNISTDataModule, FashionMNISTDataModule])
def test_mnist_reads_torchvision_raw_files(cls, mnist_dir: Path):
    datamodule = cls(data_dir=str(mnist_dir), download=False, val_size=100, batch_size=50)
    datamodule.check_available()
    datamodule.setup()
    train, val, test = datamodule.splits
    assert (len(train), len(val), len(test)) == (500, 100, 200)
    assert set(test.labels.tolist()) == set(range(10))


def test_missing_mnist_names_the_path_and_the_fix(tmp_path: Path):
    datamodule = MNISTDataModule(data_dir=str(tmp_path), download=False)
    with pytest.raises(DataUnavailable) as err:
        datamodule.check_available()
    message = str(err.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "scripts/prepare_data.py data=mnist" in message
    assert "\n" not in message


def test_truncated_mnist_is_reported_not_raised(tmp_path: Path, mnist_dir: Path):
    import shutil

    shutil.copytree(mnist_dir / "MNIST", tmp_path / "MNIST")
    images = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:5000])
    with pytest.raises(DataUnavailable) as err:
        MNISTDataModule(data_dir=str(tmp_path), download=False).check_available()
    assert "corrupt or truncated" in str(err.value) and "\n" not in str(err.value)
