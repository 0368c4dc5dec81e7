"""Whether a training set shares itself out across ranks: Lightning's DistributedSampler does it for a
map-style dataset; a stream (an IterableDataset) must do it itself and says so with this mark. The
RankWatchdog callback warns about a stream without it; hpctrain.data.iterable.ShardedIterable has it."""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

MARK = "shards_across_ranks"  # class or instance attribute of an IterableDataset that shares itself out


def shares_itself_out(dataset: Any) -> bool:
    """Whether a dataset is map-style (Lightning's sampler shares it) or a stream marked as sharing itself."""
    return not isinstance(dataset, IterableDataset) or bool(getattr(dataset, MARK, False))
