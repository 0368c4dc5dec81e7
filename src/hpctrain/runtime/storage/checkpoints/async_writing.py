"""`checkpoints.async_save=true` for single-file checkpoints (DDP, one process; FSDP2's folders are
written asynchronously by its strategy, hpctrain.runtime.distributed.fsdp).

The checkpoint is copied to host memory in the training thread (the only part training waits for: into
buffers kept from one save to the next, `staging.HostStaging`), then one writer thread saves it as
`AtomicCheckpointIO` does: into a temporary file, renamed into place once
written, so a checkpoint appears whole or not at all. One save is in flight at a time; the next save, a
removal (Lightning removes the previous best right after saving the new one), a requeue, the end of fit
and the process's end wait for it (`wait_for_saves`), and a failed write stops the run there, in one
sentence, with nothing removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hpctrain.runtime.storage.checkpoints.staging import HostStaging
from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO


class AsyncAtomicCheckpointIO(AtomicCheckpointIO):
    def __init__(self, environment: Mapping[str, str] | None = None) -> None:
        super().__init__(environment)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-checkpoint-writer")
        self._in_flight: Future[None] | None = None
        self._staging = HostStaging()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.wait_for_saves()
        checkpoint = self._plain(checkpoint)  # its first check refuses here, in the training thread
        on_host = self._staging.stage(checkpoint)  # the buffers of the previous save, written by now
        self._in_flight = self._writer.submit(
            AtomicCheckpointIO.save_checkpoint, self, on_host, path, storage_options
        )

    def wait_for_saves(self) -> None:
        """Until the save in flight is in place; its failure (`CheckpointNotSaved`) is raised here, in the
        training thread, before anything that relies on it (a removal, a requeue, the end of fit)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def remove_checkpoint(self, path: Any) -> None:
        self.wait_for_saves()  # never remove a file the writer is about to put in place
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        self.wait_for_saves()
        self._staging.close()
        super().teardown()
