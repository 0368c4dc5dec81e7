"""Batches from in-memory tensors: sharded across ranks, resumable mid-epoch, no per-sample work.

`ShardedBatchSampler` yields one index tensor per batch and `TensorDataset.__getitem__` takes that
whole tensor, so a batch costs one fancy-index instead of `batch_size` Python calls and a collate.
The sampler shards by the process group itself (like torch's DistributedSampler, which it extends so
that Lightning leaves it in place), which keeps datamodules free of rank code:

- training shards are padded to equal length, so every rank runs the same number of steps;
- evaluation shards are not padded, so every validation/test sample is counted exactly once
  (torchmetrics then sums the counts across ranks), yet every rank runs the same number of batches
  (under FSDP2 every forward is a collective): a rank whose share would make one batch fewer splits it
  into batches of nearly equal size instead (9 samples, 2 ranks, batches of 4: [4, 1] and [2, 2]).

`ResumableDataLoader` records how many batches of the current epoch it has handed out. Lightning
(>= 2.2) saves that position in every checkpoint and restores it, and the sampler is a pure function
of (seed, epoch, rank), so a run resumed mid-epoch sees exactly the batches it would have seen.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hpctrain.runtime.distributed.job_store import data_parallel
from hpctrain.runtime.errors import UserError


class TensorDataset(Dataset):
    """Images and labels held as tensors; indexing with a tensor of indices returns a whole batch."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def with_labels(self, labels: Tensor) -> TensorDataset:
        """The same images with other labels (`data.label_map`)."""
        return TensorDataset(self.images, labels)

    def subset(self, indices: Any) -> TensorDataset:
        """The samples at `indices` (a sequence, numpy array or tensor of indices), in that order."""
        return TensorDataset(*self[torch.as_tensor(indices, dtype=torch.int64)])

    def joined(self, other: TensorDataset) -> TensorDataset:
        """This dataset's samples followed by `other`'s."""
        return TensorDataset(torch.cat([self.images, other.images]), torch.cat([self.labels, other.labels]))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Tensor | int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]


def _process_group() -> tuple[int, int]:
    """The data-parallel size and rank: the process group's, or under tensor parallelism its data-parallel
    group's (the processes of one tensor-parallel group read the same batches)."""
    found = data_parallel()
    if found is not None:
        return found
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class ShardedBatchSampler(DistributedSampler):
    """Yields this rank's batches of indices for one epoch; call `set_epoch` before each epoch."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        """`num_replicas` and `rank` default to the process group's (1 and 0 without one)."""
        group_size, group_rank = _process_group()
        world_size = group_size if num_replicas is None else num_replicas
        rank = group_rank if rank is None else rank
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.drop_last_batch = drop_last
        self.pad = shuffle if pad is None else pad
        self._skip_batches = 0
        size = len(dataset)  # type: ignore[arg-type]
        share = math.ceil(size / world_size) if self.pad else len(range(rank, size, world_size))
        self.sizes = _batch_sizes(share, batch_size, drop_last)  # this rank's batches, in order
        if not self.pad and size >= world_size:  # the same number of batches on every rank
            shortest, longest = size // world_size, math.ceil(size / world_size)
            count = shortest // batch_size if drop_last else min(math.ceil(longest / batch_size), shortest)
            if drop_last:
                self.sizes = self.sizes[:count]
            elif len(self.sizes) != count:  # one batch fewer (or more) than the others: nearly equal sizes
                self.sizes = [share // count + (i < share % count) for i in range(count)]

    def in_order(self) -> ShardedBatchSampler:
        """The same batches of the same shard, unshuffled: the first batches are the same every epoch."""
        return ShardedBatchSampler(
            self.dataset,
            self.batch_size,
            shuffle=False,
            seed=self.seed,
            drop_last=self.drop_last_batch,
            pad=self.pad,
            num_replicas=self.num_replicas,
            rank=self.rank,
        )

    def skip_next(self, batches: int) -> None:
        """Start the next iteration `batches` batches into the epoch (used on resume)."""
        self._skip_batches = batches

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[Tensor]:
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=generator)
        else:
            order = torch.arange(size)
        extra = math.ceil(size / self.num_replicas) * self.num_replicas - size
        if self.pad and extra:
            order = torch.cat([order, order[:extra].repeat(math.ceil(extra / size))[:extra]])
        shard = order[self.rank :: self.num_replicas]
        skip, self._skip_batches = self._skip_batches, 0
        starts = list(itertools.accumulate(self.sizes, initial=0))
        for batch in range(skip, len(self)):
            yield shard[starts[batch] : starts[batch + 1]]


def _batch_sizes(share: int, batch_size: int, drop_last: bool) -> list[int]:
    """Batches of `batch_size` over `share` samples, the last smaller unless `drop_last` drops it."""
    full, rest = divmod(share, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ShardedBatchSampler` whose position in the epoch survives a checkpoint.

    Lightning rebuilds a loader with a sampler of its own in one case: `trainer.overfit_batches` asks for
    the samples in order (a `SequentialSampler`), passed as `sampler=` beside the arguments the loader was
    made with (the reason `sampler` is positional-only here). The rebuilt loader keeps its batch sampler,
    unshuffled (`ShardedBatchSampler.in_order`): the same first batches every epoch, one shard per rank.
    """

    sampler: ShardedBatchSampler

    def __init__(
        self, dataset: Dataset, sampler: ShardedBatchSampler | None = None, /, **kwargs: Any
    ) -> None:
        asked = kwargs.pop("sampler", None)
        if (
            isinstance(asked, ShardedBatchSampler) and sampler is None
        ):  # ResumableDataLoader(data, sampler=...)
            sampler, asked = asked, None
        if not isinstance(sampler, ShardedBatchSampler):
            given = type(asked or sampler).__name__
            raise UserError(
                f"a ResumableDataLoader was given a {given} where it needs the "
                "ShardedBatchSampler it was made with (Lightning rebuilds a loader for trainer.overfit_batches "
                "from the arguments it saw when *_dataloader() made it); build it with hpctrain.data.make_loader "
                "inside the datamodule's *_dataloader() method, not in setup()."
            )
        if asked is not None:  # Lightning's own sampler (overfit_batches): the samples in order
            sampler = sampler.in_order()
            # what Lightning passes beside it, which a loader over a batch sampler leaves to the sampler
            for key in ("shuffle", "batch_sampler", "batch_size", "drop_last"):
                kwargs.pop(key, None)
        super().__init__(dataset, batch_size=None, sampler=sampler, **kwargs)
        self._yielded = 0
        self._resume: dict[str, int] | None = None

    def __iter__(self) -> Iterator[Any]:
        start = 0
        if self._resume is not None and self._resume["epoch"] == self.sampler.epoch:
            start = min(self._resume["batches"], len(self))
        self._resume = None
        self.sampler.skip_next(start)
        self._yielded = start
        # Without workers, index the dataset directly: a batch is one tensor index, and DataLoader's
        # single-process iterator (fetcher, default_convert, pin thread) would cost more than the indexing.
        batches = self._direct() if self.num_workers == 0 else super().__iter__()
        for batch in batches:
            self._yielded += 1
            yield batch

    def _direct(self) -> Iterator[Any]:
        for index in self.sampler:
            batch = self.dataset[index]
            if self.pin_memory:
                batch = (
                    {k: t.pin_memory() for k, t in batch.items()}
                    if isinstance(batch, dict)
                    else tuple(t.pin_memory() for t in batch)
                )
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = {"epoch": int(state["epoch"]), "batches": int(state["batches"])}


def pin_memory_default(setting: bool | None, trainer: Any) -> bool:
    """`pin_memory: null` means: pinned when the trainer runs on CUDA GPUs (faster, asynchronous copies)."""
    if setting is not None:
        return bool(setting)
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


def tensors_to_device(batch: Any, device: Any) -> Any:
    """A tuple or list of tensors on `device` (None for any other batch): Lightning's generic transfer
    walks the batch structure on every step, and these batches are a few tensors."""
    if not (isinstance(batch, (tuple, list)) and all(isinstance(t, Tensor) for t in batch)):
        return None
    if device.type == "cpu":
        return batch
    return type(batch)(t.to(device, non_blocking=True) for t in batch)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    drop_last: bool = False,
    split: str = "train",
) -> ResumableDataLoader:
    """The loader every datamodule of this template returns (train: shuffle=True, eval: False).

    An evaluation split smaller than the number of processes would leave some ranks without a single
    sample: Lightning skips the loop on those ranks while the others wait for them to sync metrics,
    so it is refused here, on every rank alike, with the fix.
    """
    sampler = ShardedBatchSampler(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    size, world = len(dataset), sampler.num_replicas  # type: ignore[arg-type]
    if not sampler.pad and 0 < size < world:
        raise UserError(
            f"the {split} split has {size} sample(s) but the job runs {world} processes, so ranks {size}-{world - 1} "
            f"would get none; use at most {size} processes or a larger {split} split."
        )
    return ResumableDataLoader(
        dataset,
        sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Its own generator: creating an iterator must not draw from the global RNG, or a run resumed
        # mid-epoch would draw different dropout masks than the uninterrupted run.
        generator=torch.Generator().manual_seed(seed),
    )
