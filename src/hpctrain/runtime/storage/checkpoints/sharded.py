"""Sharded checkpoints (FSDP2): a folder per checkpoint, read with the same guarantees as a file.

    <name>.ckpt/
        .metadata        torch.distributed.checkpoint's index: which tensor lies in which shard
        __<rank>_0.distcp each rank's shard (weights and optimizer states)
        meta.pt          Lightning's part (epoch, loops, callbacks, hpctrain's stored config)
        shards.json      hpctrain's record of the shard files (size, digest of their start)

torch.distributed.checkpoint's own reader opens `.metadata` with `pickle.load` and loads non-tensor items
with `torch.load(weights_only=False)`: either could run code, and a check made on an earlier read proves
nothing about the file torch opens later (it may be swapped in between, on a shared filesystem). So the
folder is read once: `check_folder` parses `.metadata` with an unpickler that admits only DCP's own index
classes, checks every size it declares against the bytes on disk (before anything is allocated), every
shard path against the folder and every non-tensor item with `weights_only=True`; torch is then handed
that parsed index (`_ParsedIndexReader`, which never opens `.metadata`) and a planner that loads
non-tensor items with `weights_only=True` (`_WeightsOnlyPlanner`). A missing shard, a shard from another
checkpoint and a folder that is not a checkpoint are each one sentence. `read_folder` gives the folder's
content as one Lightning checkpoint dict (the whole model's weights, on one process, without a process
group), `load_into` loads it into a sharded module and its optimizers (a resumed FSDP2 run), and
`consolidate` writes it as a single file (and a .safetensors file) for any tool that wants one.
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from hpctrain.runtime import confined
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints.folders import SHARDS_FILE, start_digest

META_FILE = "meta.pt"  # Lightning's name for it (pytorch_lightning.strategies.model_parallel)
INDEX_FILE = ".metadata"
MAX_ITEM_BYTES = 64 << 20  # a non-tensor item (optimizer hyperparameters, a callback's state): numbers, names
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
        index = _IndexUnpickler(io.BytesIO(confined.read_bytes(folder / INDEX_FILE, "index", folder))).load()
    except confined.UnreadableFile:
        raise
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
        if shard.exists():
            confined.regular_file(shard, folder)  # no device, pipe or socket in its place
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
    _check_sizes(folder, index, what)
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


def _check_sizes(folder: Path, index: Any, what: str) -> None:
    """Every tensor the index declares fits in the bytes its shards hold on disk, before anything is
    allocated: its chunks cover it (their elements add up to its own) and each chunk's stored bytes are at
    least its elements' (a tensor of 2**42 elements needs that many on disk, else it is a lie)."""
    lie = None
    try:
        for key, meta in index.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                continue
            dtype = meta.properties.dtype
            if not isinstance(dtype, torch.dtype) or not all(
                isinstance(d, int) and d >= 0 for d in meta.size
            ):
                lie = f"{key} has no plain shape and dtype"
                break
            itemsize = torch.empty((), dtype=dtype).element_size()
            chunks = list(meta.chunks)
            if sum(math.prod(c.sizes) for c in chunks) != math.prod(meta.size):
                lie = f"{key}'s chunks do not add up to its {math.prod(meta.size)} elements"
                break
            for chunk in chunks:
                info = index.storage_data.get(MetadataIndex(key, chunk.offsets))
                if info is None or getattr(info, "transform_descriptors", None):
                    lie = f"{key} has a chunk that is not stored as a plain tensor"
                    break
                if int(info.length) < math.prod(chunk.sizes) * itemsize:
                    lie = (
                        f"{key} declares {math.prod(meta.size)} elements of {str(dtype).removeprefix('torch.')}, "
                        f"more than its shard holds ({int(info.length)} bytes for a chunk)"
                    )
                    break
            if lie:
                break
    except (AttributeError, TypeError, ValueError) as err:
        lie = f"its entries are malformed ({type(err).__name__})"
    if lie:
        raise ShardedCheckpointError(
            f"{what}={folder} has an index ({INDEX_FILE}) that does not match its shards on disk: {lie}; nothing was "
            "allocated or loaded: pass a complete checkpoint folder written by hpctrain."
        )


def _recorded(folder: Path, what: str) -> dict[str, tuple[int, str]]:
    """shards.json: each shard file's size and the digest of its start ({} where the folder has none)."""
    path = folder / SHARDS_FILE
    if not path.is_file():
        return {}
    try:
        recorded = confined.read_json(path, "index", folder)
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
            if int(info.length) > MAX_ITEM_BYTES:  # what a non-tensor item holds: numbers and names
                raise ShardedCheckpointError(
                    f"{what}={folder}: its item {key} claims {int(info.length)} bytes, more than a plain value of a "
                    f"checkpoint ever holds ({MAX_ITEM_BYTES}); pass a checkpoint folder written by hpctrain."
                )
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
    if not (folder / META_FILE).exists():
        raise ShardedCheckpointError(
            f"{what}={folder} has no {META_FILE} (Lightning's part of the checkpoint): its save did not complete; "
            "use another checkpoint of the run."
        )
    try:
        meta = torch.load(
            io.BytesIO(confined.read_bytes(folder / META_FILE, "index", folder)), weights_only=True
        )
    except pickle.UnpicklingError as err:
        raise ShardedCheckpointError(
            f"{what}={folder}: its {META_FILE} holds pickled Python objects, which are not loaded (weights_only=True)."
        ) from err
    return meta if isinstance(meta, dict) else {}


class _ParsedIndexReader(dcp.FileSystemReader):
    """torch's reader of a checkpoint folder, handed the index `check_folder` parsed: it reads the shards
    as torch does, and never opens `.metadata` (see the module docstring)."""

    def __init__(self, folder: Path, index: Metadata) -> None:
        super().__init__(folder)
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._index, "storage_meta", None) is None:
            self._index.storage_meta = StorageMeta()  # as torch's own reader does for an older index
        self._index.storage_meta.load_id = self.load_id
        return self._index


class _WeightsOnlyPlanner(dcp.DefaultLoadPlanner):
    """torch's planner, with non-tensor items (optimizer hyperparameters) loaded by `weights_only` loading:
    torch's own loads them with `weights_only=False`, which runs whatever a pickle calls."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except Exception as err:
            raise ShardedCheckpointError(
                f"its item {read_item.dest_index.fqn} holds Python objects that weights_only loading refuses "
                f"({' '.join(str(err).split())[:120]}); save plain values only."
            ) from err
        buffer = io.BytesIO()
        torch.save(plain, buffer)  # plain values, written here: what torch's planner reads back is ours
        buffer.seek(0)
        super().load_bytes(read_item, buffer)


def _load(state: dict[str, Any], folder: Path, reader: _ParsedIndexReader, what: str) -> None:
    """dcp.load from the parsed index, every failure one sentence."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(state, storage_reader=reader, planner=_WeightsOnlyPlanner())
    except dcp.CheckpointException as err:
        failure = next(iter(err.failures.values()), (err, None))[0]
        if isinstance(failure, ShardedCheckpointError):
            raise ShardedCheckpointError(f"{what}={folder}: {failure}") from None
        raise ShardedCheckpointError(
            f"{what}={folder} could not be read ({type(failure).__name__}: {' '.join(str(failure).split())[:160]}); "
            "pass a complete checkpoint folder written by hpctrain."
        ) from None


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
    }  # sizes checked against the bytes on disk (`check_folder`)
    content["state_dict"] = state
    if weights:
        _load({"state_dict": state}, folder, _ParsedIndexReader(folder, index), what)
    return content


def load_into(
    folder: str | Path, module: torch.nn.Module, optimizers: Mapping[str, Any], strict: bool = True
) -> dict[str, Any]:
    """A resumed FSDP2 run: the folder's weights into the sharded `module`, its optimizer states into
    `optimizers` (Lightning's keys, optimizer_0, ...), from one read of its index, as
    Lightning's ModelParallelStrategy.load_checkpoint does with torch's own reader; Lightning's part
    (meta.pt, read with weights_only) is returned."""
    folder = Path(folder)
    index = check_folder(folder)
    reader = _ParsedIndexReader(folder, index)
    module_state = {"state_dict": get_model_state_dict(module)}
    _load(module_state, folder, reader, "ckpt_path")
    module.load_state_dict(module_state["state_dict"], strict=strict)
    for key, optimizer in optimizers.items():
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        _load(optimizer_state, folder, reader, "ckpt_path")
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return read_meta(folder)


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
