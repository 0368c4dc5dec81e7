"""What differs between the Hydra and OmegaConf releases of hpctrain's support window, in one place:
Hydra 1.3 and 1.4, OmegaConf 2.3 and 2.4 (`make versions PRE=1` runs the quick tier on the latter).

- `version_base`: Hydra 1.3 needs "1.3" (without it a run takes 1.1's defaults and changes into its run
  directory); Hydra 1.4 deprecates the parameter, its own defaults being 1.3's. `VERSION_BASE` is what to
  pass to `initialize_config_dir`; hpctrain.runtime.run.entry.main_args() what to pass to `@hydra.main`.
- Hydra 1.4 asks for an allowlist of what it instantiates from a config: `@hydra.main`'s covers what
  Hydra itself builds (`hydra.callbacks`); hpctrain's calls pass their own (hpctrain.runtime.config.targets).
- Resolvers: OmegaConf 2.4 renames `register_new_resolver` to `register_resolver` (2.3's
  `register_resolver` is the legacy one, with other semantics).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import omegaconf
from omegaconf import OmegaConf


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


# read from the installed distribution: `import hydra` imports most of Hydra, which a replayed answer
# (hpctrain.runtime.config.answers) and the preflight never need
HYDRA_1_4 = _minor(version("hydra-core")) >= (1, 4)
OMEGACONF_2_4 = _minor(omegaconf.__version__) >= (2, 4)

VERSION_BASE: dict[str, str] = {} if HYDRA_1_4 else {"version_base": "1.3"}


def register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """Register (or replace) an OmegaConf resolver `${name:...}`, on OmegaConf 2.3 and 2.4 alike."""
    if OMEGACONF_2_4:
        OmegaConf.register_resolver(name, resolver, replace=True)
    else:
        OmegaConf.register_new_resolver(name, resolver, replace=True)
