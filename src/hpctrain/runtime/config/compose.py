"""Where the configs live, and composing them outside `@hydra.main` (scripts, tests, benchmarks).

Everything that composes a config goes through `compose`, so scripts and tests see exactly what
`python src/train.py` sees: the same search path, the same resolvers. No torch import here.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.config.versions import VERSION_BASE
from hpctrain.runtime.environment import launched

MARKER = Path("conf") / "train.yaml"  # what makes a directory a project's code root


def find_code_root() -> Path:
    """The directory holding the running code's conf/ and src/, wherever hpctrain is installed, the first of:
    $HPCTRAIN_CODE_ROOT; the project that carries this hpctrain (<root>/src/hpctrain, as a generated project
    and a snapshot of one do); the nearest directory holding conf/train.yaml above the running script (not a
    library's module, as under submitit), then above the working directory; else the working directory."""
    named = os.environ.get("HPCTRAIN_CODE_ROOT")
    if named:
        return Path(named).resolve()
    carried = Path(__file__).resolve().parents[4]  # <root>/src/hpctrain/runtime/config/compose.py
    if (carried / MARKER).is_file():
        return carried
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    script = Path(main).resolve().parent if main else None
    installed = script is not None and (
        script.is_relative_to(Path(sys.prefix).resolve()) or "site-packages" in script.parts
    )
    for start in ([script] if script and not installed else []) + [Path.cwd()]:
        for folder in (start, *start.parents):
            if (folder / MARKER).is_file():
                return folder
    return Path.cwd()


CODE_ROOT = find_code_root()
# The project whose logs/, data/ and .venv runs use: the same directory, unless the code runs from a
# snapshot taken at submission (hpctrain.runtime.snapshot), which names the project it came from.
PROJECT_ROOT = launched.project_root(CODE_ROOT)
CONF_DIR = CODE_ROOT / "conf"  # the project's configs: the primary ones, and its groups (model, data, ...)
HPCTRAIN_CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # hpctrain's groups (pkg://hpctrain.conf)


def config_dirs() -> tuple[Path, Path]:
    """Where Hydra looks for configs, in its order: the project's conf/ first, then hpctrain's."""
    return CONF_DIR, HPCTRAIN_CONF_DIR


def group_options(group: str) -> dict[str, Path]:
    """A config group's options, each with the file Hydra composes (the project's, where both have one)."""
    found: dict[str, Path] = {}
    for root in reversed(config_dirs()):
        found.update({p.stem: p for p in (root / group).glob("*.yaml")})
    return dict(sorted(found.items()))


def config_groups() -> list[str]:
    """Every folder of configs, in the project's conf/ or in hpctrain's (`schema` holds none)."""
    return sorted(
        {
            str(p.relative_to(root))
            for root in config_dirs()
            for p in root.rglob("*")
            if p.is_dir() and any(p.glob("*.yaml"))
        }
    )


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python src/<config_name>.py <overrides>` would run with (Hydra's runtime keys unset)."""
    from hydra import (
        compose as hydra_compose,  # Hydra waits: a stored answer (answers) is printed before it is imported
    )
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    running = GlobalHydra.instance().hydra  # inside @hydra.main (an export's check, an error report)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), **VERSION_BASE):
            return hydra_compose(config_name, overrides=list(overrides))
    finally:
        GlobalHydra.instance().hydra = running  # the running app's, as it was


def task_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's overrides as typed. Read without resolving: in Hydra's config an override such as
    `model.num_classes=${data.n_classes}` is a string OmegaConf would try to resolve there, and fail."""
    return [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]


def searchpath_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's `hydra.searchpath=...` (Hydra keeps it with its own overrides, not the task's)."""
    found = [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.hydra, resolve=False) or []]
    return [o for o in found if o.lstrip("+").startswith("hydra.searchpath=")]


@functools.cache
def project_packages() -> tuple[str, ...]:
    """The project's own packages (src/<package>/, hpctrain and Hydra's plugins aside): what Hydra 1.4's
    allowlists admit for results and for what Hydra itself builds (`entry.main_args`)."""
    src = CONF_DIR.parent / "src"
    if not src.is_dir():
        return ()
    return tuple(
        sorted(
            p.name
            for p in src.iterdir()
            if (p / "__init__.py").is_file() and p.name not in ("hpctrain", "hydra_plugins")
        )
    )
