"""The host copy an asynchronous save makes before training goes on: the only part of the save that
training waits for (`async_writing` for single files, `folder_saves` for FSDP2's folders).

The copy goes into buffers kept from one save to the next, pinned where CUDA exists: a fresh allocation
per save pays for the host memory's first touch (page faults, zeroing) on every save (on a busy host,
twice the copy itself), and only pinned memory takes a copy from the GPU at full speed and without
blocking. What is left of the stall is one copy of the state at the host's memory bandwidth. The buffers are
torch.distributed.checkpoint's `DefaultStager`, which keys them by the storage of the tensor copied:
parameters and optimizer states keep their storages from step to step, so after the first save each is
copied into the buffer it had; a tensor made anew for each checkpoint (an RNG state) gets a fresh one.
A buffer is written over by the next save only after the previous one's writer finished with it: both
callers wait for the save in flight before they stage another.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


class HostStaging:
    """A reusable host copy of checkpoints (`stage`), until `close`."""

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None

    @property
    def stager(self) -> DefaultStager:
        """torch.distributed.checkpoint's stager, made on first use (and again after `close`)."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda,  # copied from the GPU at full speed, and without a bounce buffer
                use_shared_memory=False,  # the writer is a thread of this process
                use_async_staging=False,  # training waits for the copy: the state must not change during it
                use_non_blocking_copy=cuda,  # the copies queued at once, then one synchronisation
            )
            self._stager = DefaultStager(options)
        return self._stager

    def stage(self, checkpoint: Any) -> Any:
        """`checkpoint` with every tensor copied to host memory (other values copied as they are)."""
        return self.stager.stage(checkpoint)

    def close(self) -> None:
        """Frees the buffers (the end of fit: the test after it saves nothing)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
