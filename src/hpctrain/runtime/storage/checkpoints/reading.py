"""How a checkpoint is read: with `weights_only=True`, every way a file can be wrong (missing, truncated,
random bytes, pickled code, another model's weights) said in one sentence; the config it was trained with
(`stored_config`, `config_from_checkpoint`), and what resuming from it overrides (`resume_overrides`).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor

from hpctrain.runtime.config import targets
from hpctrain.runtime.environment import launched
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


def stored_config(
    path: str | Path,
    groups: tuple[str, ...] = ("model", "data", "monitor"),
    trusted_targets: Any = None,
    what: str = "ckpt_path",
    how: str = "",
    content: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The groups of the config a checkpoint of this template was trained with ({} for others), as data:
    plain containers whose every `_target_` is one the project's configs name (or `trusted_targets`),
    else refused in one sentence (`hpctrain.runtime.config.targets`, rule 1). Build them with
    `targets.build_stored`: their strings are text, never resolved."""
    stored = (content if content is not None else read(path, what, weights=False)).get(CONFIG_KEY) or {}
    if not isinstance(stored, dict) or not all(isinstance(stored.get(g, {}), dict) for g in groups):
        raise UnreadableCheckpoint(
            f"{what}={path} holds something else where its config should be; pass a checkpoint written by "
            "this template, or choose the model and data it holds weights for: model=<option> data=<option>."
        )
    chosen = {group: stored[group] for group in groups if group in stored}
    searchpath = "" if how else recorded_searchpath(path)  # `how`: hpctrain.load, which no searchpath helps
    targets.check_stored(chosen, f"{what}={path}", trusted_targets, how, searchpath)
    return chosen


def _without_unresolved(checkpoint: Path, group: str, node: Any, given: set[str]) -> Any:
    """`node` (a stored group, plain) ready for OmegaConf, which would resolve a string holding `${` (a
    file's `${oc.env:...}` would read this machine's environment): such a string is refused in one
    sentence, unless the command line replaces it (`given`: its dotted keys), when it is left out. Such a
    string is most often a value the training run read through an interpolation, which its records keep
    as written (`hpctrain.runtime.config.redact`): the command line gives this machine's value."""

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, f"{key}[{i}]") for i, v in enumerate(value)]
        if not (isinstance(value, str) and ("${" in value or value == "???")):
            return value  # (OmegaConf reads "???" as a missing value)
        if any(key == g or key.startswith((f"{g}.", f"{g}[")) for g in given):
            return None  # replaced by the command line's value
        raise UnreadableCheckpoint(
            f"ckpt_path={checkpoint} stores {key}={value[:80]!r}, an interpolation kept as written (a file's strings "
            "are never resolved, so that one cannot read this machine's environment or run a resolver); pass "
            f"the value on the command line: {key}=<value>."
        )

    return clean(node, group)


def recorded_searchpath(path: str | Path) -> str:
    """The `hydra.searchpath=...` override of the training run that wrote the checkpoint at `path`
    (<run dir>/checkpoints/<file>; Hydra's record of the run, .hydra/hydra.yaml, beside), or "": what to
    pass again so that the configs it was built from are the project's again. Only named in a refusal:
    nothing here is trusted."""
    record = Path(path).parent.parent / ".hydra" / "hydra.yaml"
    try:
        overrides = yaml.safe_load(record.read_text())["hydra"]["overrides"]["hydra"] or []
    except (OSError, yaml.YAMLError, KeyError, TypeError):
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
    if (
        trainable_only.stored(content) is not None
    ):  # its frozen part is the model's own, built from its source
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
    stored = ((content or read(path)).get(CONFIG_KEY) or {}).get("model")
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
    cfg: DictConfig, checkpoint: Path, overrides: list[str], trusted_targets: list[str] | None = None
) -> DictConfig:
    """`cfg` with `model` and `data` replaced by the checkpoint's, unless the command line chose them.

    `model=...` / `data=...` keep the eval config's choice; `model.<key>=...` / `data.<key>=...` are
    applied on top of the checkpoint's config, and so is `monitor` (the metric it was trained to
    watch). Every class it names must be the project's or in `trusted_targets` (checkpoints.trusted_targets).
    The data directory is this command's `paths.data_dir` (said in the log), and
    the training job's node-local staging directory (`data.stage_dir`) is not reused unless given again.
    """
    chosen = [
        group
        for group in ("model", "data", "monitor")
        if any(o.lstrip("+~").startswith((f"{group}=", f"{group}/")) for o in overrides)
    ]
    kept = tuple(g for g in ("model", "data", "monitor") if g not in chosen)
    stored = stored_config(checkpoint, kept, trusted_targets)
    for group in kept:
        if group not in stored:
            continue
        dotted = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith(f"{group}.")]
        given = {o.partition("=")[0] for o in dotted}
        node = dict(stored[group])
        if group == "data" and "data_dir" in node and "data.data_dir" not in given:
            # the checkpoint's data_dir is where the training job's machine kept its data
            node["data_dir"] = str(cfg.paths.data_dir)
            if launched.is_rank_zero():
                log.info(
                    "data: read from %s (paths.data_dir of this command; the checkpoint was trained on %s); "
                    "pass paths.data_dir=<dir> to read another",
                    node["data_dir"],
                    stored[group].get("data_dir"),
                )
        if group == "data" and "stage_dir" in node and "data.stage_dir" not in given:
            node["stage_dir"] = None  # the training job's node-local scratch is gone (or another job's)
        node = _without_unresolved(checkpoint, group, node, given)
        replacement = OmegaConf.merge(OmegaConf.create(node), OmegaConf.from_dotlist(dotted).get(group) or {})
        with open_dict(cfg):
            cfg[group] = replacement
    return cfg
