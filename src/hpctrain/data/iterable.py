"""Streams (a `torch.utils.data.IterableDataset`) shared out across ranks and loader workers.

Lightning adds a DistributedSampler only to map-style datasets: an IterableDataset under DDP is read
in full by every rank, which then all train on the same samples, and nothing says so. Each copy of a
stream must take its own share, and the copies are one per rank *and* per loader worker:

    from hpctrain.data.iterable import ShardedIterable, stream_share

    train_set = ShardedIterable(MyStream(...))       # wrap any IterableDataset: item k goes to copy k % n

    class MyShards(IterableDataset):                   # or share out by hand, e.g. whole files per copy
        shards_across_ranks = True                     # tells the template this stream shares itself out
        def __iter__(self):
            share = stream_share()
            for path in self.files[share.index :: share.count]:
                yield from read(path)

A stream that is neither wrapped nor marked gets one warning at the start of a DDP fit, with this fix.
If the ranks' shares yield different numbers of batches, the job ends within seconds naming the rank
that ran out first (`hpctrain.runtime.distributed.watchdog`), instead of hanging in the next collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from hpctrain.runtime.distributed.job_store import data_parallel

__all__ = ["MARK", "ShardedIterable", "StreamShare", "shares_itself_out", "stream_share"]

MARK = "shards_across_ranks"  # class or instance attribute of an IterableDataset that shares itself out


def shares_itself_out(dataset: Any) -> bool:
    """Whether a training set shares itself out across ranks: a map-style dataset is shared by Lightning's
    DistributedSampler; a stream must do it itself and say so with `MARK` (the RankWatchdog callback warns
    about a stream without it)."""
    return not isinstance(dataset, IterableDataset) or bool(getattr(dataset, MARK, False))


@dataclass(frozen=True)
class StreamShare:
    """This copy of the stream: copy `index` of `count` (ranks x loader workers), and its parts."""

    index: int
    count: int
    rank: int
    world_size: int
    worker: int
    num_workers: int


def stream_share() -> StreamShare:
    """Which share of a stream the calling code reads: call it inside `__iter__` (in the loader worker).
    Under tensor parallelism the ranks of a tensor-parallel group read the same share: the stream is
    shared out over the data-parallel group."""
    world_size, rank = 1, 0
    if dist.is_available() and dist.is_initialized():
        world_size, rank = data_parallel() or (dist.get_world_size(), dist.get_rank())
    info = get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return StreamShare(
        rank * num_workers + worker, world_size * num_workers, rank, world_size, worker, num_workers
    )


class ShardedIterable(IterableDataset):
    """Any IterableDataset, of which each rank and loader worker reads every `count`-th item.

    The shares differ by at most one item; with `drop_last` (of the loader) or a stream whose length
    is a multiple of the batch size times the copies, every rank runs the same number of steps.
    """

    shards_across_ranks = True

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[Any]:
        share = stream_share()
        return itertools.islice(iter(self.stream), share.index, None, share.count)
