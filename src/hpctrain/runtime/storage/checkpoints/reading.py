"""How a checkpoint is read: with `weights_only=True`, every way a file can be wrong (missing, truncated,
random bytes, pickled code, another model's weights) said in one sentence; what it proposes for the config
it was trained with (`proposal`, `config_from_checkpoint`), and what resuming from it overrides
(`resume_overrides`).
"""

from __future__ import annotations

import logging
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, open_dict
from torch import Tensor

from hpctrain.runtime import confined
from hpctrain.runtime.config import proposals
from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.config.proposals import Proposal
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import sharded, trainable_only

log = logging.getLogger(__package__)

CONFIG_KEY = f"{__package__}_config"  # the resolved model, data and monitor config stored in every checkpoint


class UnreadableCheckpoint(UserError):
    pass


def read(path: str | Path, what: str = "ckpt_path", weights: bool = True) -> dict[str, Any]:
    """The checkpoint's contents (tensors memory-mapped, so reading only the config is cheap). A sharded
    checkpoint folder is checked and read whole (`weights=False`: its tensors' shapes only)."""
    path = Path(path)
    if path.is_dir():
        return sharded.read_folder(path, what, weights=weights)
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):  # a device or a pipe would never end
        raise UnreadableCheckpoint(
            f"{what}={path} is not a regular file (a device, a pipe or a socket); pass a .ckpt file."
        )
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")
        raise UnreadableCheckpoint(
            f"{what}={path} holds pickled Python objects ({detail or 'not plain tensors'}), which are not "
            "loaded because loading them can run arbitrary code (weights_only=True); save the checkpoint "
            "with plain tensors and containers only (do not put modules or objects in save_hyperparameters)."
        ) from err
    except Exception as err:
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise UnreadableCheckpoint(
            f"{what}={path} is not a readable checkpoint ({reason}); it may be truncated or not a "
            "checkpoint at all: pass a complete .ckpt file (see <run dir>/checkpoints/)."
        ) from err
    if not isinstance(content, dict) or "state_dict" not in content:
        raise UnreadableCheckpoint(f"{what}={path} is not a Lightning checkpoint (it has no state_dict).")
    return content


def proposal(path: str | Path, content: dict[str, Any], what: str = "ckpt_path") -> Proposal | None:
    """What the checkpoint at `path` proposes for the config a reader builds (None: it is not one of this
    template's, and holds no config): plain data, checked for its shape (`hpctrain.runtime.config.proposals`)."""
    stored = content.get(CONFIG_KEY)
    return None if stored is None else proposals.proposal_of(stored, f"{what}={path}" if what else str(path))


def recorded_searchpath(path: str | Path) -> str:
    """The `hydra.searchpath=...` override of the training run that wrote the checkpoint at `path`
    (<run dir>/checkpoints/<file>; Hydra's record of the run, .hydra/hydra.yaml, beside), or "": what to
    pass again so that the configs it was built from are the project's again. Only named in a refusal:
    nothing here is trusted."""
    record = Path(path).parent.parent / ".hydra" / "hydra.yaml"
    try:
        overrides = (
            confined.read_yaml(record, folder=record.parent.parent)["hydra"]["overrides"]["hydra"] or []
        )
    except (OSError, yaml.YAMLError, KeyError, TypeError, UserError):
        return ""
    found = [str(o).lstrip("+") for o in overrides if str(o).lstrip("+").startswith("hydra.searchpath=")]
    # words to type, from a file: printable and short, or nothing
    return found[-1] if found and found[-1].isprintable() and len(found[-1]) <= 300 else ""


def check_matches_model(
    path: str | Path, module: torch.nn.Module, what: str = "ckpt_path", content: dict[str, Any] | None = None
) -> None:
    """Refuse a checkpoint whose weights do not fit `module` (another model, or other sizes); `content`:
    the checkpoint already read, if the caller has it."""
    content = content or read(path, what)
    stored: dict[str, Tensor] = content["state_dict"]
    expected = module.state_dict()
    missing = sorted(set(expected) - set(stored))
    if trainable_only.stored(content) is not None:  # its frozen part is the model's own, from its source
        missing = sorted(set(missing) - set(trainable_only.frozen_names(module)))
    unexpected = sorted(set(stored) - set(expected))
    resized = sorted(
        k for k in set(expected) & set(stored) if tuple(expected[k].shape) != tuple(stored[k].shape)
    )
    if not (missing or unexpected or resized):
        return
    details = []
    if missing:
        details.append(f"{len(missing)} weight(s) missing, e.g. {missing[0]}")
    if unexpected:
        details.append(f"{len(unexpected)} unknown, e.g. {unexpected[0]}")
    if resized:
        key = resized[0]
        details.append(
            f"{len(resized)} of another size, e.g. {key} {list(stored[key].shape)} vs {list(expected[key].shape)}"
        )
    raise UnreadableCheckpoint(
        f"{what}={path} holds the weights of a different model than the one configured ({'; '.join(details)}); "
        "pass a checkpoint of this model, or the model=/data= options it was trained with."
    )


_OPTIMIZER_NODES = ("optimizer", "scheduler", "lr_scheduler")
_OPTIMIZER_LEAVES = ("lr", "learning_rate", "weight_decay", "momentum", "betas", "eps")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(_flat(value, f"{prefix}{key}."))
    return flat


def _optimizer_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """The entries of a flattened model config that the optimizer and schedule are built from."""
    return {
        key: value
        for key, value in flat.items()
        if any(part in _OPTIMIZER_NODES for part in key.split(".")[:-1])
        or key.rsplit(".", 1)[-1] in _OPTIMIZER_LEAVES
    }


def resume_overrides(
    path: str | Path, model_cfg: dict[str, Any], content: dict[str, Any] | None = None
) -> str | None:
    """What resuming from `path` does to the configured optimizer and schedule, in one line (None if
    nothing): Lightning restores the optimizer and schedulers from the checkpoint, so a value changed on
    the command line (model.optimizer.lr=...) would otherwise be ignored without a word. An optimizer of
    another class cannot take the saved state at all: that is refused, in one sentence."""
    found = proposal(path, content or read(path))
    stored = found.values.get("model") if found is not None else None
    if not isinstance(stored, dict):
        return None  # not a checkpoint of this template: nothing to compare with
    then, now = _optimizer_keys(_flat(stored)), _optimizer_keys(_flat(model_cfg))
    for key in sorted(k for k in now if k.endswith("_target_") and k in then and then[k] != now[k]):
        raise UserError(
            f"ckpt_path={path} was trained with model.{key}={then[key]}, but model.{key}={now[key]} is configured: "
            "resuming continues the checkpoint's optimizer state, which the other class cannot take; resume with "
            f"the optimizer it was saved with, or start a new run from its weights: init_from.path={path}."
        )
    changed = [k for k in sorted(now) if not k.endswith(("_target_", "_partial_")) and then.get(k) != now[k]]
    if not changed:
        return None
    shown = ", ".join(f"model.{k}={now[k]} (the checkpoint has {then.get(k)})" for k in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return (
        f"resuming restores the optimizer and schedule saved in {path}, so these configured values are not "
        f"used: {shown}{more}; to train from its weights with a fresh optimizer, use init_from.path={path} instead."
    )


def config_from_checkpoint(
    cfg: DictConfig, checkpoint: Path, overrides: list[str]
) -> tuple[DictConfig, dict[str, str]]:
    """`cfg` (eval's, predict's, export's) with its model, data and monitor as this project composes what
    the checkpoint proposes (`proposals.composed`): its options and values, the command line's overrides
    of those groups, of the paths and of the search path winning. A checkpoint that is not one of this
    template's keeps the command's own (model=... and data=... choose them). Returns the config and the
    options it took for those groups."""
    found = proposal(checkpoint, read(checkpoint, weights=False))
    if found is None:
        return cfg, {}
    try:
        composed = proposals.composed(found, overrides, lambda chosen: compose("train", chosen))
    except proposals.ProposalRefused as err:
        searchpath = recorded_searchpath(checkpoint)
        if searchpath and not any(o.lstrip("+").startswith("hydra.searchpath=") for o in overrides):
            raise proposals.ProposalRefused(
                f"{err} Its training run searched more configs: {searchpath}."
            ) from err
        raise
    with open_dict(cfg):
        for group in proposals.GROUPS:
            if group in composed:
                cfg[group] = composed[group]
    return cfg, proposals.chosen(found, overrides)
