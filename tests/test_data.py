"""Datamodules and the sampler/loader: sharding, exact eval counts, mid-epoch resume, clear data errors."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from pytorch_lightning import Callback, LightningModule

from hpctrain.data.loading import ShardedBatchSampler, TensorDataset, make_loader
from myproject.data.digits import DigitsDataModule
from myproject.data.synthetic import RandomDataModule


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


def test_eval_shards_give_every_rank_the_same_number_of_batches_and_each_sample_once():
    """Under FSDP2 every forward is a collective: a rank with one batch fewer than another would leave the
    other waiting in its next forward until the timeout. Without fake samples: a rank whose share would make
    one batch fewer splits it into nearly equal batches; one process keeps its batches as they were."""
    for n in range(1, 40):
        for world in range(1, min(n, 5) + 1):
            for batch_size in range(1, 7):
                samplers = [
                    ShardedBatchSampler(_dataset(n), batch_size, shuffle=False, num_replicas=world, rank=r)
                    for r in range(world)
                ]
                batches = [[b.tolist() for b in s] for s in samplers]
                assert len({len(b) for b in batches}) == 1, (n, world, batch_size, batches)
                assert all(len(s) == len(b) for s, b in zip(samplers, batches, strict=True))
                assert sorted(i for b in batches for batch in b for i in batch) == list(range(n))
                largest = max(len(batch) for b in batches for batch in b)
                assert largest <= max(batch_size, 2)  # batches of 1: a longer share puts 2 in one batch
                if world == 1:
                    assert [len(batch) for batch in batches[0]] == [batch_size] * (n // batch_size) + (
                        [n % batch_size] if n % batch_size else []
                    )
    nine = [
        [len(b) for b in ShardedBatchSampler(_dataset(9), 4, False, num_replicas=2, rank=r)] for r in (0, 1)
    ]
    assert nine == [[4, 1], [2, 2]]  # the split: rank 1 had one batch, rank 0 two
    dropped = [
        len(ShardedBatchSampler(_dataset(12), 3, False, drop_last=True, num_replicas=5, rank=r))
        for r in range(5)
    ]
    assert dropped == [0] * 5  # shares of 3 and 2: no rank has a full batch that every rank has


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


def test_a_loader_rebuilt_with_a_sequential_sampler_keeps_its_batches_in_order():
    """Lightning's trainer.overfit_batches rebuilds the training loader from the arguments it was made with
    plus `sampler=SequentialSampler(...)`: the rebuilt loader yields the same batch size and rank's shard,
    unshuffled, so every epoch trains on the same first batches."""
    from torch.utils.data import SequentialSampler

    data = _dataset(40)
    shuffled = make_loader(data, 4, shuffle=True, seed=3)
    sampler = shuffled.sampler
    rebuilt = type(shuffled)(
        data,
        sampler,
        sampler=SequentialSampler(data),
        shuffle=False,
        batch_sampler=None,
        generator=shuffled.generator,
    )
    for epoch in (0, 1):
        rebuilt.sampler.set_epoch(epoch)
        assert [b[1].tolist() for b in rebuilt][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(rebuilt) == len(shuffled) == 10
    two_ranks = ShardedBatchSampler(data, 4, shuffle=True, seed=3, num_replicas=2, rank=1)
    assert next(b.tolist() for b in two_ranks.in_order()) == [1, 3, 5, 7]


def test_a_loader_rebuilt_without_its_batch_sampler_is_one_sentence():
    from torch.utils.data import SequentialSampler

    from hpctrain.runtime.errors import UserError

    data = _dataset(8)
    with pytest.raises(UserError, match="given a SequentialSampler where it needs the ShardedBatchSampler"):
        type(make_loader(data, 4, shuffle=True, seed=3))(data, sampler=SequentialSampler(data))


def test_digits_look_like_mnist():
    datamodule = DigitsDataModule(batch_size=32)
    datamodule.setup()
    train, val, test = datamodule.splits
    assert len(train) + len(val) + len(test) == 1797
    assert train.images.shape[1:] == (1, 28, 28) and train.images.dtype == torch.uint8
    assert train.images[:, :, :4].max() == 0  # a 4-pixel empty border, as in MNIST
    images, _ = datamodule.on_after_batch_transfer(next(iter(datamodule.train_dataloader())), 0)
    assert images.dtype == torch.float32 and abs(float(images.mean())) < 0.5


class _FlippingData(RandomDataModule):
    """Random images with a random horizontal flip as augmentation, counting what it augmented."""

    def __init__(self, **kwargs) -> None:
        super().__init__(num_samples=96, val_samples=16, test_samples=16, batch_size=8, **kwargs)
        self.augmented = 0

    def augment(self, images: torch.Tensor) -> torch.Tensor:
        assert images.dtype == torch.uint8  # before normalisation
        self.augmented += 1
        flip = torch.rand(len(images), device=images.device) < 0.5
        return torch.where(flip[:, None, None, None], images.flip(-1), images)


class _SaveAtStep(Callback):
    """Saves a checkpoint at a step boundary inside fit, as the requeue path does, then training goes on."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(callbacks=(), ckpt_path: Path | None = None):
    from pytorch_lightning import Trainer

    from hpctrain.callbacks.resume_state import ResumeState
    from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO
    from myproject.models.classifier import ImageClassifier
    from myproject.models.nets import MLP

    torch.manual_seed(0)
    model = ImageClassifier(MLP(hidden_sizes=(32,), dropout=0.5), optimizer=partial(torch.optim.SGD, lr=0.1))
    data = _FlippingData()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ResumeState(), *callbacks],
        plugins=[AtomicCheckpointIO()],
    )
    trainer.fit(model, data, ckpt_path=ckpt_path, weights_only=True)
    return model, data


def test_augmentation_runs_on_training_batches_only_and_resumes_exactly(tmp_path: Path):
    checkpoint = tmp_path / "mid.ckpt"
    uninterrupted, data = _fit(callbacks=[_SaveAtStep(17, checkpoint)])  # mid-way through the second epoch
    assert data.augmented == 2 * 12  # 96 samples / 8 per batch, two epochs; no validation batch
    resumed, data = _fit(ckpt_path=checkpoint)
    assert data.augmented == 24 - 17
    for a, b in zip(uninterrupted.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_per_channel_normalisation():
    data = RandomDataModule(image_shape=(3, 2, 2), mean=(0.0, 0.5, 1.0), std=(1.0, 0.5, 0.25))
    images = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    normalised = data.normalise(images)
    assert normalised[0, :, 0, 0].tolist() == [1.0, 1.0, 0.0]


class _ThreeValBatches(LightningModule):
    """Loaders of 10 train, 3 val and 6 test batches of 4, from the module's own hooks."""

    def train_dataloader(self):
        return make_loader(_dataset(40), 4, shuffle=True, seed=0)

    def val_dataloader(self):
        return make_loader(_dataset(12), 4, shuffle=False, seed=0)

    def test_dataloader(self):
        return [
            make_loader(_dataset(24), 4, shuffle=False, seed=0),
            make_loader(_dataset(40), 4, shuffle=False, seed=0),
        ]


@pytest.mark.parametrize(
    ("stage", "limits", "expected"),
    [
        ("fit", {"limit_train_batches": 0.05, "limit_val_batches": 0.1}, {"train": 1, "val": 1}),
        ("fit", {"limit_train_batches": 0.25, "limit_val_batches": 0.5}, {"train": 0.25, "val": 0.5}),
        ("fit", {"limit_val_batches": 2, "limit_train_batches": 1.0}, {"val": 2, "train": 1.0}),
        ("test", {"limit_test_batches": 0.1}, {"test": 1}),  # the smaller of its two loaders decides
        ("test", {"limit_test_batches": 0.2}, {"test": 0.2}),
    ],
)
def test_a_fraction_of_a_split_that_comes_to_no_batch_is_one_batch(stage, limits, expected):
    """Lightning refuses `int(batches x fraction) == 0` ("0.1 * 3 < 1") once the data is set up, for the
    test split after the whole fit; BatchLimits makes such a fraction 1 batch as the stage is set up, and
    leaves every other limit as given."""
    from pytorch_lightning import Trainer

    from hpctrain.callbacks.batch_limits import BatchLimits

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **limits)
    BatchLimits().setup(trainer, _ThreeValBatches(), stage)
    assert {split: getattr(trainer, f"limit_{split}_batches") for split in expected} == expected
