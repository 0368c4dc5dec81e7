"""Saving a sharded checkpoint (FSDP2: one folder, one shard file per rank), synchronously or not.

Every rank writes its shard into a new folder beside the target; once all have, rank 0 moves the folder
into place (`folders.commit_folder`): a kill at any moment leaves the old checkpoint or the new one,
whole. With `checkpoints.async_save`, the state is copied to host memory (into buffers kept from one
save to the next, `staging.HostStaging`), training goes on while a thread writes it (torch.distributed.checkpoint's `async_save`), and the folder is moved into place
when the write completed; one save is in flight at a time. A failed write or commit stops the run in
one sentence (`CheckpointNotSaved`), every committed checkpoint as it was.

The strategy (`hpctrain.runtime.distributed.fsdp.HydraModelParallelStrategy`) does the writing itself
(Lightning's `save_checkpoint`); `FolderSaves`, given to it by the build, decides where, when it counts
as saved, and what may be removed: Lightning removes the previous best right after saving the new one,
and that waits here until the new one is committed.
"""

from __future__ import annotations

import functools
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpctrain.runtime.storage.checkpoints import sharded
from hpctrain.runtime.storage.checkpoints.folders import (
    CheckpointNotSaved,
    commit_folder,
    record_shards,
    staging_path,
    writer_tag,
)
from hpctrain.runtime.storage.checkpoints.sharded import META_FILE
from hpctrain.runtime.storage.checkpoints.staging import HostStaging
from hpctrain.runtime.storage.checkpoints.writing import Save, without_numpy


class FolderSaves:
    """One strategy's folder checkpoints: `save`, `wait` (for an asynchronous save in flight), `remove`."""

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = bool(asynchronous)
        self.last_save: Save | None = None  # the newest save: path, step, at, seconds (the signal's lead)
        self._in_flight: tuple[Any, _Commit] | None = None  # the asynchronous save being written
        self._save_group: Any = None  # its own gloo process group (on the default one, DCP's save hangs)
        self._staging = HostStaging()  # the host copy of an asynchronous save, reused by the next

    def save(
        self,
        strategy: Any,
        checkpoint: dict[str, Any],
        filepath: Any,
        write: Callable[[dict[str, Any], Path], None],
    ) -> None:
        """`write(checkpoint, folder)`: the strategy's own write of a checkpoint into a folder, on every
        rank; numpy values in its state are written as Python numbers and tensors (`without_numpy`)."""
        checkpoint = without_numpy(checkpoint)
        path = Path(strategy.broadcast(str(filepath)))
        token, tag = strategy.broadcast((uuid.uuid4().hex[:8], writer_tag()))  # rank 0's: one folder for all
        staging = staging_path(path, token, tag)
        if self.asynchronous:
            self._save_in_background(strategy.global_rank, checkpoint, path, staging, token)
            return
        started, step = time.perf_counter(), checkpoint.get("global_step")
        try:
            write(checkpoint, staging)
            strategy.barrier("hpctrain-sharded-save")
            if strategy.global_rank == 0:
                record_shards(staging)
                commit_folder(staging, path, token)
        except OSError as err:
            raise CheckpointNotSaved(path, err) from err
        strategy.barrier("hpctrain-sharded-commit")
        self.last_save = Save(str(path), step, time.time(), time.perf_counter() - started)

    def _save_in_background(
        self, rank: int, checkpoint: dict[str, Any], path: Path, staging: Path, token: str
    ) -> None:
        self.wait()
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        staging.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if rank == 0:
            torch.save(checkpoint, staging / META_FILE)
        future = dcp.async_save(
            state, checkpoint_id=staging, process_group=self._save_group, async_stager=self._staging.stager
        )
        commit = _Commit(path)
        if rank == 0:  # DCP's future ends after every rank's shard and the index are written
            future.add_done_callback(functools.partial(commit.when_written, staging, token))
        else:
            commit.done.set()
        self._in_flight = (future, commit)

    def wait(self) -> None:
        """Until the asynchronous save in flight (if any) is written and, on rank 0, moved into place; its
        failure is raised here (`CheckpointNotSaved`), before anything relies on it."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        future, commit = in_flight
        try:
            future.result()
        except Exception as err:
            raise CheckpointNotSaved(commit.path, err) from err
        commit.done.wait()  # the callback may still run after result() returned
        if commit.error is not None:
            raise CheckpointNotSaved(commit.path, commit.error) from commit.error

    def close(self) -> None:
        """The asynchronous save in flight written, and the host buffers freed (the end of fit)."""
        self.wait()
        self._staging.close()

    @staticmethod
    def is_folder(path: Any) -> bool:
        return sharded.is_sharded(path)

    @staticmethod
    def load(path: Any, module: Any, optimizers: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """A resumed run's folder, read once (`sharded.load_into`)."""
        return sharded.load_into(path, module, optimizers, strict)

    def remove(self, rank: int, filepath: Any) -> None:
        """Never before the new checkpoint is committed (an asynchronous save is waited for, and its
        failure stops the run first)."""
        self.wait()
        if rank == 0:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


class _Commit:
    """Rank 0's commit of an asynchronous save, run in DCP's writer thread once the write completed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = threading.Event()
        self.error: BaseException | None = None

    def when_written(self, staging: Path, token: str, future: Any) -> None:
        try:
            future.result()
            record_shards(staging)
            commit_folder(staging, self.path, token)
        except BaseException as err:  # raised in the training thread by wait; the old one stays
            self.error = err
        finally:
            self.done.set()
