"""How a checkpoint is written: atomically, and only with what `weights_only=True` loading can read back.

`AtomicCheckpointIO` writes every checkpoint (last, best-k, requeue) to a temporary file in the same
directory and renames it, so a process killed during a save leaves the previous file whole (Lightning's
own writer stages the file in /tmp and moves it, which on another filesystem is a copy that a kill can
cut short). It keeps only the plain values of what `save_hyperparameters()` recorded
(`plain_hyperparameters`): a network or a partial optimizer kept there would make the file unreadable
with `weights_only=True`, and hpctrain rebuilds every model from its config, never from those. The
first checkpoint of a process is checked whole (`check_readable`) before it is written. Each save is
timed (`last_save`): the run warns when a save does not fit in the requeue signal's lead
(hpctrain.callbacks.attempt_progress.AttemptProgress).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from pytorch_lightning import LightningDataModule, LightningModule  # key names, as in lightning.pytorch
from torch import Tensor

from hpctrain.runtime.config import redact
from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.storage.checkpoints.folders import CheckpointNotSaved, temporary_file
from hpctrain.runtime.storage.checkpoints.reading import UnreadableCheckpoint

log = logging.getLogger(__package__)


@dataclass(frozen=True)
class Save:
    """One checkpoint written: where, at which step, when it was done (seconds since the epoch) and how
    long it took."""

    path: str
    step: int | None
    at: float
    seconds: float


class AtomicCheckpointIO(LightningPart, lightning="lightning_fabric.plugins.io.torch_io.TorchCheckpointIO"):
    """torch.save into `.<name>.tmp-<writer>` beside the target, fsync, then an atomic rename; a failure is
    `CheckpointNotSaved` (one sentence), the previous file untouched."""

    last_save: Save | None = None  # the newest save of this process

    def __init__(self, environment: Mapping[str, str] | None = None) -> None:
        super().__init__()
        # {value: interpolation} of what the config read from the environment (redact.environment_values):
        # put back as the interpolation wherever a class kept the value in save_hyperparameters()
        self.environment = dict(environment or {})

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        started = time.perf_counter()
        checkpoint = self._plain(checkpoint)
        path = Path(path)
        tmp = temporary_file(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except (
            OSError,
            RuntimeError,
        ) as err:  # a full disk, a quota, a filesystem gone: torch says RuntimeError
            raise CheckpointNotSaved(path, err) from err
        finally:
            tmp.unlink(missing_ok=True)
        seconds = time.perf_counter() - started
        self.last_save = Save(str(path), checkpoint.get("global_step"), time.time(), seconds)

    _checked = False  # the first checkpoint of the process is checked for objects, then said once

    def _plain(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        checkpoint, left_out = plain_hyperparameters(checkpoint)
        checkpoint = without_numpy(checkpoint)
        for key in _HPARAMS:  # no secret kept there either: URLs' credentials, values from the environment
            if key in checkpoint:
                checkpoint[key] = redact.scrub(checkpoint[key], self.environment)
        if self._checked:
            return checkpoint
        self._checked = True
        check_readable(checkpoint)
        if left_out:
            log.info(
                "checkpoints keep the plain values of save_hyperparameters() only; left out: %s (objects "
                "cannot be read back with weights_only=True; this template rebuilds the model from its "
                "config, and Lightning's load_from_checkpoint needs them passed in, e.g. net=...)",
                ", ".join(left_out),
            )
        return checkpoint


def without_numpy(value: Any) -> Any:
    """`value` with numpy scalars as Python numbers and numpy arrays as tensors, at any depth: what a
    scheduler written with numpy leaves in the optimizer's state (`lr` as a numpy.float64), which
    weights_only=True loading refuses. The containers are new; nothing else changes."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if type(value) in (dict, OrderedDict):
        return type(value)((k, without_numpy(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(without_numpy(v) for v in value)
    return value


def check_readable(checkpoint: dict[str, Any]) -> None:
    """Refuse, before it is written, a checkpoint that `weights_only=True` loading could not read back (an
    object put there by a hook or a callback's state_dict): its structure, with every tensor replaced
    by an empty one, goes through torch.save and torch.load as the file would."""
    buffer = io.BytesIO()
    torch.save(_skeleton(checkpoint), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        parts, found = _first_object(checkpoint) or ((), None)
        top = parts[0] if parts else ""
        source = _SOURCES.get(top) or (f"callback {parts[1]}'s state_dict" if top == "callbacks" else "")
        key = ".".join(str(part) for part in parts)
        where = f"{key} (from {source or 'on_save_checkpoint'})" if key else "an entry"
        raise UnreadableCheckpoint(
            f"the checkpoint's {where} holds a {type(found).__module__}.{type(found).__qualname__}, which "
            "weights_only=True loading refuses (resume, eval and predict would fail on it); keep tensors, numbers, "
            "strings, lists and dicts there (save an object's state, not the object)."
        ) from err


_SOURCES = {
    "optimizer_states": "the optimizer's state_dict",
    "lr_schedulers": "a scheduler's state_dict",
    "state_dict": "the model's state_dict",
    "loops": "Lightning's loops",
}


def _skeleton(value: Any) -> Any:
    if isinstance(value, Tensor):
        return torch.empty(0, dtype=value.dtype)
    if type(value) in (dict, OrderedDict):  # a dict subclass stays itself: loading must accept its class
        return {k: _skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _first_object(node: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], Any] | None:
    """The keys leading to the first value in `node` that is no plain data, and that value."""
    if type(node) in (dict, OrderedDict, list, tuple):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            found = _first_object(value, (*path, key))
            if found:
                return found
        return None
    return None if isinstance(node, _PLAIN) else (path, node)


# where Lightning puts what save_hyperparameters() recorded, of the module and of the datamodule,
# and the class of an OmegaConf container recorded there
_HPARAMS = (LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, LightningDataModule.CHECKPOINT_HYPER_PARAMS_KEY)
_HPARAMS_TYPES = (
    LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE,
    LightningDataModule.CHECKPOINT_HYPER_PARAMS_TYPE,
)
_PLAIN = (str, int, float, bool, complex, bytes, type(None), Tensor, torch.Size, torch.dtype, torch.device)


def plain_hyperparameters(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`checkpoint` with its recorded hyperparameters reduced to plain values (numbers, strings, tensors,
    lists and dicts of them; OmegaConf containers as plain ones; paths as strings), and the dotted names
    of what was left out, with its type (e.g. `net (SimpleDenseNet)`). The checkpoint is not changed."""
    if not any(key in checkpoint for key in _HPARAMS):
        return checkpoint, []
    left_out: list[str] = []
    plain = {k: v for k, v in checkpoint.items() if k not in _HPARAMS_TYPES}
    for key in _HPARAMS:
        if key in plain:
            plain[key] = _plain_value(plain[key], "", left_out)
    return plain, left_out


_LEFT_OUT = object()


def _plain_value(value: Any, name: str, left_out: list[str]) -> Any:
    """`value` as plain data, or _LEFT_OUT (its name and type appended to `left_out`)."""
    if isinstance(value, DictConfig | ListConfig):
        try:
            value = OmegaConf.to_container(value, resolve=True)
        except Exception:  # an interpolation that cannot be resolved here: keep it as written
            value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        kept = {k: _plain_value(v, f"{name}{k}.", left_out) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _LEFT_OUT}
    if type(value) in (list, tuple):
        items = [_plain_value(v, name, []) for v in value]
        if all(item is not _LEFT_OUT for item in items):
            return type(value)(items)
    kind = type(value).__name__
    if isinstance(value, functools.partial):  # a `_partial_: true` optimizer or scheduler
        kind = f"partial {getattr(value.func, '__name__', type(value.func).__name__)}"
    left_out.append(f"{name[:-1] or 'hyperparameters'} ({kind})")
    return _LEFT_OUT
