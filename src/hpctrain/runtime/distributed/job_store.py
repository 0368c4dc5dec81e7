"""How the ranks of a job tell each other things without a collective: the job's key-value store (the
TCPStore every process group has, served by rank 0's process), the keys hpctrain writes there, and this
process's rank. Nothing here imports torch: a process without a process group has no store."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from hpctrain.runtime import run_state
from hpctrain.runtime.environment import launched

FAILED_KEY = f"{__package__}/failed-rank"  # the first failure's line (failures)
POSTED_KEY = f"{__package__}/posted"  # the rank that posts the failure (notify): one post per job
DATA_END_KEY = f"{__package__}/data-end"  # + /<epoch>: the first rank whose training data ran out, and when
POSITION_KEY = (
    f"{__package__}/position"  # + /<rank>: "<batches> <phase> <loop> <epoch> <step> <host>", each second
)
DUMP_KEY = f"{__package__}/dump-stacks"  # set: every rank's watchdog appends its stacks to its file, once


def rank() -> int:
    """This process's global rank (the process group's, else the launcher's)."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()

    return launched.global_rank()


def store() -> Any | None:
    """The job's store, when this process is one of several ranks of a process group."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a process group without a store (not the case for env:// or TCP init)
        return None


@dataclass
class DataParallel:
    """One run's data-parallel group, where it is not the world (`hpctrain.runtime.run_state`): a next job
    in this process without tensor parallelism shards over its world again."""

    group: tuple[int, int] | None = None  # (size, rank)


def set_data_parallel(size: int, rank: int) -> None:
    """Under tensor parallelism the processes of one tensor-parallel group must read the same batches:
    hpctrain's loaders shard the data over the data-parallel group's `size` and `rank`, not the world's."""
    run_state.part(DataParallel).group = (int(size), int(rank))


def data_parallel() -> tuple[int, int] | None:
    return run_state.part(DataParallel).group
