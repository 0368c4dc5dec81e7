"""Sharded checkpoints (FSDP2): a folder per checkpoint, read with the same guarantees as a file.

    <name>.ckpt/
        .metadata        torch.distributed.checkpoint's index: which tensor lies in which shard
        __<rank>_0.distcp each rank's shard (weights and optimizer states)
        meta.pt          Lightning's part (epoch, loops, callbacks, hpctrain's stored config)
        shards.json      hpctrain's record of the shard files (size, digest of their start)

torch.distributed.checkpoint reads `.metadata` with `pickle.load` and non-tensor items with
`torch.load(weights_only=False)`: either could run code. `check_folder` reads `.metadata` with an
unpickler that admits only DCP's own index classes, and every non-tensor item with
`weights_only=True`, before anything else reads the folder; it also names a missing shard, a shard
from another checkpoint and a folder that is not a checkpoint, each in one sentence. `read_folder`
then gives the folder's content as one Lightning checkpoint dict (the whole model's weights, on one
process, without a process group), and `consolidate` writes that as a single file (and a
.safetensors file) for any tool that wants one.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run.checkpoints.folders import SHARDS_FILE, start_digest

META_FILE = "meta.pt"  # Lightning's name for it (pytorch_lightning.strategies.model_parallel)
INDEX_FILE = ".metadata"
STATE_PREFIX = "state_dict."

# Exactly the (module, name) pairs torch.distributed.checkpoint writes into an index (tests/test_checkpoint_trust.py
# enumerates what the installed torch writes, so an upgrade that adds a class fails a test, not a user's load).
_DCP = "torch.distributed.checkpoint"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        *(("builtins", name) for name in ("set", "frozenset", "slice", "tuple", "list", "dict")),
        *(
            ("pathlib", name)
            for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
        ),
        ("torch", "Size"),
        ("torch", "device"),
        (
            "torch.serialization",
            "_get_layout",
        ),  # a layout by its name, as torch's weights_only unpickler allows
    ]
)


class ShardedCheckpointError(UserError):
    pass


class _IndexUnpickler(pickle.Unpickler):
    """Admits exactly the classes DCP writes into an index, torch's dtypes and memory formats, and plain
    containers, each by its exact (module, name): never a dotted name (pickle resolves `a.b` attribute by
    attribute, so `os.system` is reachable from any module that imports os)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.memory_format | torch.layout):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def is_sharded(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / INDEX_FILE).is_file()


def read_index(folder: Path, what: str = "ckpt_path") -> Any:
    try:
        with open(folder / INDEX_FILE, "rb") as file:
            index = _IndexUnpickler(file).load()
    except pickle.UnpicklingError as err:
        raise ShardedCheckpointError(
            f"{what}={folder} has an index ({INDEX_FILE}) that holds other Python objects ({err}), which are not "
            "loaded because loading them can run arbitrary code; pass a checkpoint folder written by hpctrain."
        ) from err
    except Exception as err:
        raise ShardedCheckpointError(
            f"{what}={folder} has an unreadable index ({INDEX_FILE}: {' '.join(str(err).split())[:120]}); it was cut "
            "short or is not a checkpoint: pass a complete checkpoint folder (see <run dir>/checkpoints/)."
        ) from err
    if not (
        isinstance(index, Metadata)
        and isinstance(index.state_dict_metadata, dict)
        and isinstance(index.storage_data, dict)
    ):
        raise ShardedCheckpointError(
            f"{what}={folder} has an index ({INDEX_FILE}) that is not a checkpoint's (it holds a "
            f"{type(index).__name__}); pass a complete checkpoint folder (see <run dir>/checkpoints/)."
        )
    return index


def shard_path(folder: Path, relative: Any, what: str = "ckpt_path") -> Path:
    """A shard file the index names, which must lie inside the checkpoint folder (a name, no `..`)."""
    name = str(relative)
    path = folder / name
    inside = folder.resolve()
    if (
        not name
        or Path(name).is_absolute()
        or ".." in Path(name).parts
        or not path.resolve().is_relative_to(inside)
    ):
        raise ShardedCheckpointError(
            f"{what}={folder}: its index names the shard {name!r}, which lies outside the checkpoint folder; "
            "a checkpoint only reads its own files: pass a checkpoint folder written by hpctrain."
        )
    return path


def check_folder(folder: str | Path, what: str = "ckpt_path") -> Any:
    """Everything a sharded checkpoint must be before DCP reads it (see the module docstring); its index."""
    folder = Path(folder)
    if not is_sharded(folder):
        raise ShardedCheckpointError(
            f"{what}={folder} is a folder but not a checkpoint (it has no {INDEX_FILE}); pass a .ckpt file or a "
            "sharded checkpoint folder (see <run dir>/checkpoints/)."
        )
    index = read_index(folder, what)
    files: dict[str, int] = {}
    try:
        for info in index.storage_data.values():
            shard_path(folder, info.relative_path, what)
            end = int(info.offset) + int(info.length)
            files[info.relative_path] = max(files.get(info.relative_path, 0), end)
    except (AttributeError, TypeError, ValueError) as err:
        raise ShardedCheckpointError(
            f"{what}={folder} has an index ({INDEX_FILE}) whose shard entries are malformed ({err}); pass a complete "
            "checkpoint folder (see <run dir>/checkpoints/)."
        ) from err
    for name, end in sorted(files.items()):
        shard = folder / name
        if not shard.is_file():
            raise ShardedCheckpointError(
                f"{what}={folder} is missing its shard {name} (one of {len(files)}): a rank's save did not "
                "complete or the folder was copied in part; use another checkpoint of the run."
            )
        if shard.stat().st_size < end:
            raise ShardedCheckpointError(
                f"{what}={folder}: its shard {name} is shorter than its index says ({shard.stat().st_size} < {end} "
                "bytes): it is truncated or from another checkpoint; use another checkpoint of the run."
            )
    recorded = _recorded(folder, what)
    for name, (size, digest) in recorded.items():
        shard = shard_path(folder, name, what)
        if shard.is_file() and (shard.stat().st_size != size or start_digest(shard) != digest):
            raise ShardedCheckpointError(
                f"{what}={folder}: its shard {name} is not the one this checkpoint was saved with (another "
                "checkpoint's or run's shard was put in its place); use another checkpoint of the run."
            )
    _check_plain_items(folder, index, what)
    return index


def _recorded(folder: Path, what: str) -> dict[str, tuple[int, str]]:
    """shards.json: each shard file's size and the digest of its start ({} where the folder has none)."""
    path = folder / SHARDS_FILE
    if not path.is_file():
        return {}
    try:
        recorded = json.loads(path.read_text())
        return {str(name): (int(size), str(digest)) for name, (size, digest) in recorded.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise ShardedCheckpointError(
            f"{what}={folder}: its {SHARDS_FILE} is not a record of shard files ({type(err).__name__}); it was cut "
            "short or replaced: use another checkpoint of the run."
        ) from err


def _check_plain_items(folder: Path, index: Any, what: str) -> None:
    """Every non-tensor item (optimizer hyperparameters, ...) loads with weights_only=True."""

    for key, meta in index.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        for index_key, info in index.storage_data.items():
            if index_key.fqn != key:
                continue
            with open(shard_path(folder, info.relative_path, what), "rb") as file:
                file.seek(int(info.offset))
                data = file.read(int(info.length))
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except Exception as err:
                raise ShardedCheckpointError(
                    f"{what}={folder}: its item {key} holds Python objects that weights_only loading refuses "
                    f"({' '.join(str(err).split())[:120]}); save plain values only."
                ) from err


def read_meta(folder: Path, what: str = "ckpt_path") -> dict[str, Any]:
    try:
        meta = torch.load(folder / META_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise ShardedCheckpointError(
            f"{what}={folder} has no {META_FILE} (Lightning's part of the checkpoint): its save did not complete; "
            "use another checkpoint of the run."
        ) from err
    except pickle.UnpicklingError as err:
        raise ShardedCheckpointError(
            f"{what}={folder}: its {META_FILE} holds pickled Python objects, which are not loaded (weights_only=True)."
        ) from err
    return meta if isinstance(meta, dict) else {}


def read_folder(folder: str | Path, what: str = "ckpt_path", weights: bool = True) -> dict[str, Any]:
    """The checkpoint as one dict: Lightning's part, and the whole model's `state_dict` (on CPU; with
    `weights=False` as meta tensors, their shapes only: what a check needs, without reading a shard)."""

    folder = Path(folder)
    index = check_folder(folder, what)
    content = read_meta(folder, what)
    device = "cpu" if weights else "meta"
    state = {
        key[len(STATE_PREFIX) :]: torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
        for key, meta in index.state_dict_metadata.items()
        if key.startswith(STATE_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    content["state_dict"] = state
    if not weights:
        return content
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load({"state_dict": state}, checkpoint_id=str(folder), no_dist=True)
    return content


def consolidate(folder: str | Path, output: str | Path, safetensors: bool = True) -> list[Path]:
    """One weights-only checkpoint file from a folder (Lightning's part without the optimizer states, and
    the whole model), and beside it the weights as .safetensors; never over an existing file."""
    folder, output = Path(folder), Path(output)
    targets = [output] + ([output.with_suffix(".safetensors")] if safetensors else [])
    existing = [t for t in targets if t.exists()]
    if existing:
        raise ShardedCheckpointError(
            f"{existing[0]} exists; pass another output path (nothing was overwritten)."
        )
    content = read_folder(folder, "checkpoint")
    content.pop("optimizer_states", None)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(content, output)
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in content["state_dict"].items()}, str(targets[1]))
    return targets
