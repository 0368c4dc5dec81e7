"""Rebuilding a run's model (and data) config from the config stored in its checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from hpctrain.checkpointing import CONFIG_KEY
from hpctrain.errors import UserError


def _read_stored_config(checkpoint: Path) -> dict:
    try:
        # mmap: only the config is read here; Lightning reads the tensors once, in trainer.test
        content = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"ckpt_path={checkpoint} is not a readable checkpoint ({first_line}).") from err
    if not isinstance(content, dict) or "state_dict" not in content:
        raise UserError(f"ckpt_path={checkpoint} is not a Lightning checkpoint (it has no state_dict).")
    return content.get(CONFIG_KEY) or {}


def config_from_checkpoint(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """`cfg` with `model` and `data` replaced by the checkpoint's, unless the command line chose them.

    `model=...` / `data=...` keep the eval config's choice; `model.<key>=...` / `data.<key>=...` are
    applied on top of the checkpoint's config. The data directory is always this machine's.
    """
    stored = _read_stored_config(checkpoint)
    for group in ("model", "data"):
        if group not in stored or any(o.lstrip("+~").startswith(f"{group}=") for o in overrides):
            continue
        dotted = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith(f"{group}.")]
        replacement = OmegaConf.merge(
            OmegaConf.create(stored[group]), OmegaConf.from_dotlist(dotted).get(group) or {}
        )
        if group == "data" and "data_dir" in replacement:
            replacement.data_dir = cfg.paths.data_dir
        with open_dict(cfg):
            cfg[group] = replacement
    return cfg
