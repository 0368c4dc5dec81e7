"""Checkpoints of the trainable parameters only (`checkpoints.trainable_only`): a frozen part is rebuilt.

A model whose larger part is frozen and rebuilt from its source (a pretrained base read from its files,
with LoRA adapters) need not write that part into every checkpoint: a 16 GB base with a 0.2 GB adapter would write 16 GB at every
save and every requeue. With trainable-only checkpoints the module's state dict leaves out its frozen
parameters (their optimizer holds no state for them), so every save (single file or sharded folder,
synchronous or asynchronous) stores the trainable parameters, buffers and optimizer state only. The
checkpoint records a fingerprint of the frozen part (`FROZEN_KEY`): each frozen parameter's name, shape,
dtype and two sums of its values (world-size independent: under FSDP2 the shards' sums are added up).

A run resumed, requeued, evaluated or exported from such a checkpoint builds its model from the config as
always (the frozen base from its source, e.g. `model.base.path`), then loads the checkpoint over it; a base
whose fingerprint differs from the recorded one is refused in one sentence.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpctrain.runtime.errors import UserError

FROZEN_KEY = "hpctrain_frozen_part"  # in a trainable-only checkpoint: the frozen part's fingerprint


class DifferentBase(UserError):
    pass


def frozen_names(module: nn.Module) -> list[str]:
    """Every name of a frozen parameter: a tied one (an output layer sharing the embedding) under each."""
    return [name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def mostly_frozen(module: nn.Module) -> bool:
    """Whether frozen parameters hold more than half of the module's parameter elements."""
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return frozen * 2 > sum(p.numel() for p in module.parameters())


def rebuilt_from_source(module: nn.Module) -> bool:
    """`checkpoints.trainable_only=auto`: most parameters are frozen, and the module builds them from their
    files itself (`pretrained_files()`, hpctrain.runtime.distributed.materialize). A part frozen after
    `init_from.path` loaded it is not: a resumed or evaluated run does not load it again, so it is stored."""
    return callable(getattr(module, "pretrained_files", None)) and mostly_frozen(module)


def fingerprint(module: nn.Module) -> dict[str, Any]:
    """The frozen part's names, shapes, dtypes and per-parameter sums (float64) of values and of squares,
    with a digest of all of it; collective under FSDP2 (every rank calls it)."""
    named = dict(module.named_parameters())
    names = sorted(n for n, p in named.items() if not p.requires_grad)
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    groups: dict[Any, list[int]] = {}  # (mesh, dimension) -> the rows sharded along it
    for i, name in enumerate(names):
        param = named[name].detach()
        local = param.to_local() if callable(getattr(param, "to_local", None)) else param
        values = local.to(torch.float64)
        sums[i, 0], sums[i, 1] = values.sum().cpu(), values.square().sum().cpu()
        for dim, placement in enumerate(getattr(param, "placements", ())):  # sharded: a part of the whole
            if not placement.is_replicate():  # (Shard, or FSDP2's _StridedShard over tensor parallelism)
                groups.setdefault((param.device_mesh, dim), []).append(i)
    for (mesh, dim), rows in groups.items():
        part = sums[rows].to(mesh.device_type)
        dist.all_reduce(part, group=mesh.get_group(dim))
        sums[rows] = part.cpu()
    shapes = [list(named[n].shape) for n in names]
    dtypes = [str(named[n].dtype).removeprefix("torch.") for n in names]
    rounded = [[f"{v:.9g}" for v in row] for row in sums.tolist()]
    digest = hashlib.sha256(json.dumps([names, shapes, dtypes, rounded]).encode()).hexdigest()[:16]
    return {"digest": digest, "names": names, "shapes": shapes, "dtypes": dtypes, "sums": sums}


def check_same_base(stored: Mapping[str, Any], module: nn.Module, where: str) -> None:
    """Refuse, in one sentence, a frozen part other than the one the checkpoint was trained on."""
    found = fingerprint(module)
    if stored.get("names") != found["names"] or stored.get("shapes") != found["shapes"]:
        missing = sorted(set(stored.get("names", [])) - set(found["names"]))
        extra = sorted(set(found["names"]) - set(stored.get("names", [])))
        what = (
            f"{len(missing)} of its frozen parameters are not frozen here (e.g. {missing[0]})"
            if missing
            else f"{len(extra)} frozen parameters here it does not know (e.g. {extra[0]})"
            if extra
            else "its frozen parameters have other shapes"
        )
        raise DifferentBase(
            f"{where} stores trainable parameters only, over a frozen part that differs from this model's ("
            f"{what}); build the model it was trained with (its model.* settings, the same base)."
        )
    sums, expected = found["sums"], stored["sums"].to(torch.float64)
    if not torch.allclose(sums, expected, rtol=1e-6, atol=1e-9):
        row = int((sums - expected).abs().sum(dim=1).argmax())
        raise DifferentBase(
            f"{where} was trained over another frozen base than the one this run built (parameter "
            f"{found['names'][row]} differs; digest {stored.get('digest')} vs {found['digest']}); point the model "
            "at the base it was trained on (model.base.path) or start a new run."
        )


def stored(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """The frozen part's fingerprint a trainable-only checkpoint records (None for a full checkpoint)."""
    found = checkpoint.get(FROZEN_KEY)
    return found if isinstance(found, dict) else None


def without_frozen(module: nn.Module) -> Any:
    """A state-dict hook that leaves the module's frozen parameters out of its state dict."""
    frozen = set(frozen_names(module))

    def hook(_module: nn.Module, state: dict[str, Tensor], prefix: str, _meta: Any) -> None:
        for name in frozen:
            state.pop(prefix + name, None)

    return hook


def frozen_may_be_missing(module: nn.Module) -> Any:
    """A load-state-dict hook that accepts a state dict without the module's frozen parameters."""
    frozen = set(frozen_names(module))

    def hook(_module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in frozen]

    return hook


def load_weights(module: nn.Module, content: Mapping[str, Any], where: str) -> None:
    """Load a checkpoint's state dict into a module built from its config: whole, or (a trainable-only
    checkpoint) over the frozen part the module built, after checking it is the one trained on."""
    fingerprint_stored = stored(content)
    if fingerprint_stored is None:
        module.load_state_dict(content["state_dict"])
        return
    check_same_base(fingerprint_stored, module, where)
    handle = module.register_load_state_dict_post_hook(frozen_may_be_missing(module))
    try:
        module.load_state_dict(content["state_dict"])
    finally:
        handle.remove()


def size_note(module: nn.Module) -> str:
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    return f"{_mb(trainable)} of {_mb(total)} of parameters"


def _mb(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.2f} MB"
