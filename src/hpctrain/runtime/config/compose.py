"""Where the configs live, and composing them outside `@hydra.main` (scripts, tests, benchmarks).

Everything that composes a config goes through `compose`, so scripts and tests see exactly what
`python src/train.py` sees: the same search path, the same resolvers. No torch import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime import cluster

CODE_ROOT = Path(__file__).resolve().parents[4]  # the directory holding the running code's conf/ and src/
# The project whose logs/, data/ and .venv runs use: the same directory, unless the code runs from a
# snapshot taken at submission (hpctrain.runtime.snapshot), which names the project it came from.
PROJECT_ROOT = cluster.project_root(CODE_ROOT)
CONF_DIR = CODE_ROOT / "conf"


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python src/<config_name>.py <overrides>` would run with (Hydra's runtime keys unset)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # e.g. when called while @hydra.main reports an error
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


def task_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's overrides as typed. Read without resolving: in Hydra's config an override such as
    `model.num_classes=${data.n_classes}` is a string OmegaConf would try to resolve there, and fail."""
    return [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]
