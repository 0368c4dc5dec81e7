"""A large pretrained base: built without memory (the meta device), filled from its files where it lives.

A LightningModule that fine-tunes a pretrained network builds the network's architecture inside
`empty_weights()` (its parameters then take no memory) and says where their values are with a method
`pretrained_files()`: {parameter name in the LightningModule: (safetensors file, tensor name)}. Whatever
it builds outside the context (adapters, a new head) is real and initialised as usual, and buffers are
always real (a rotary embedding's frequencies are computed when the module is built).

`materialize(module, device)` then gives the empty parameters memory and reads their values:
- one process, or DDP: when the model is built (each process holds the whole network anyway);
- FSDP2: after sharding (`hpctrain.runtime.distributed.fsdp`), each rank reading every tensor from the
  memory-mapped file and keeping only its own shard (`distribute_tensor` without communication), one
  tensor at a time. The ranks of a node read the same pages of the node's page cache, so a base staged
  to node-local disk is read from disk once per node, and no rank ever holds the whole base.
A parameter left empty that the files do not hold is one sentence, before any step. Once they are read,
the module's `pretrained_loaded()`, if it has one, is called. A parameter shared
by several modules (tied input and output embeddings) stays shared: `to_empty` gives each module its own
tensor, and a file stores the shared tensor once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor

from hpctrain.runtime.errors import UserError

log = logging.getLogger("hpctrain")


class PretrainedFilesError(UserError):
    pass


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Parameters registered inside are created on the meta device (no memory, no initialisation work);
    buffers stay real. Only modules built inside the block are affected, and only while it runs."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_empty_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def materialize(module: nn.Module, device: torch.device | str, checkpoint_fills: bool = False) -> int:
    """Give `module`'s meta parameters memory on `device` and fill them from `module.pretrained_files()`;
    real parameters and buffers keep their values. Works on a plain module and on one sharded by FSDP2
    (each rank then fills its shards only). `checkpoint_fills`: a reader's model, built without memory,
    whose checkpoint fills what the files do not name next. Returns how many tensors were read."""
    empty = [name for name, p in module.named_parameters() if p.is_meta]
    if not empty:
        return 0
    if any(p.is_meta for p in module.parameters(recurse=False)) and not checkpoint_fills:
        raise PretrainedFilesError(
            f"{type(module).__name__} holds empty parameters of its own, outside any submodule; build the "
            "network as a submodule (e.g. self.net) inside hpctrain.empty_weights()."
        )
    files = _pretrained_files(module) if hasattr(module, "pretrained_files") or not checkpoint_fills else {}
    empty = [name for name in empty if name in files or not checkpoint_fills]
    missing = [name for name in empty if name not in files]
    if missing:
        raise PretrainedFilesError(
            f"{type(module).__name__} left {len(missing)} parameter(s) empty that pretrained_files() does not "
            f"name ({', '.join(missing[:3])}); build them outside hpctrain.empty_weights(), or name their "
            "tensors in pretrained_files()."
        )
    kept = {name: _local(t).detach().clone() for name, t in _tensors(module) if not t.is_meta}
    shared = _shared_parameters(module)
    if checkpoint_fills and any(p.is_meta for p in module.parameters(recurse=False)):
        module.to_empty(device=device, recurse=False)
    for child in module.children():  # the networks (FSDP2 roots), not the metrics beside them
        if has_empty_parameters(child):
            child.to_empty(device=device)  # FSDP2 re-registers its sharded parameters (FSDPModule._apply)
    for (first, first_name), *others in shared:
        for owner, name in others:
            setattr(owner, name, getattr(first, first_name))
    tensors = dict(_tensors(module))
    with torch.no_grad():
        for name, value in kept.items():
            _local(tensors[name]).copy_(value)
        read = 0
        for path, names in _by_file(files, empty).items():
            read += _fill_from(path, {n: tensors[n] for n in names}, files)
    if callable(loaded := getattr(module, "pretrained_loaded", None)):
        loaded()  # what the module does with the values once they are in (e.g. quantize its base)
    return read


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter held by several modules is registered, first as `named_modules` meets it."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((owner, name))
    return [where for where in places.values() if len(where) > 1]


def _pretrained_files(module: nn.Module) -> Mapping[str, tuple[str, str]]:
    method = getattr(module, "pretrained_files", None)
    if not callable(method):
        raise PretrainedFilesError(
            f"{type(module).__name__} builds parameters inside hpctrain.empty_weights() but has no "
            "pretrained_files() saying where their values are; add the method ({parameter name: (safetensors "
            "file, tensor name)})."
        )
    return method()


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's sharded parameters), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _by_file(files: Mapping[str, tuple[str, str]], names: list[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name in names:
        grouped.setdefault(str(files[name][0]), []).append(name)
    return grouped


def _fill_from(path: str, targets: dict[str, torch.Tensor], files: Mapping[str, tuple[str, str]]) -> int:
    from safetensors import safe_open  # the llm and export extras bring it

    if not Path(path).is_file():
        raise PretrainedFilesError(
            f"pretrained_files() names {path}, which does not exist; check model.base.path (the folder of "
            "the base's config.json and *.safetensors)."
        )
    with safe_open(path, framework="pt", device="cpu") as stored:
        present = set(stored.keys())
        for name, target in targets.items():
            key = files[name][1]
            if key not in present:
                raise PretrainedFilesError(
                    f"{path} holds no tensor {key!r} for parameter {name}; the files are of another "
                    "architecture than the config builds: point model.base.path at the base they belong to."
                )
            full = stored.get_tensor(key)
            if tuple(full.shape) != tuple(target.shape):
                raise PretrainedFilesError(
                    f"{path}: tensor {key!r} has shape {tuple(full.shape)} but parameter {name} has "
                    f"{tuple(target.shape)}; the files belong to another configuration of the model."
                )
            _local(target).copy_(_shard_of(full.to(target.dtype), target))
    return len(targets)


def _shard_of(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` as `target` (a DTensor) is placed: computed locally, no communication."""
    mesh = getattr(target, "device_mesh", None)
    if mesh is None:
        return full
    placed: Any = distribute_tensor(full, mesh, target.placements, src_data_rank=None)
    return placed.to_local()
