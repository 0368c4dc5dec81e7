"""Rebuilding a run's model (and data) config from the config stored in its checkpoint."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from hpctrain import checkpointing


def config_from_checkpoint(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """`cfg` with `model` and `data` replaced by the checkpoint's, unless the command line chose them.

    `model=...` / `data=...` keep the eval config's choice; `model.<key>=...` / `data.<key>=...` are
    applied on top of the checkpoint's config. The data directory is always this machine's.
    """
    stored = checkpointing.stored_config(checkpoint)
    for group in ("model", "data"):
        chosen = any(o.lstrip("+~").startswith((f"{group}=", f"{group}/")) for o in overrides)
        if group not in stored or chosen:
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
