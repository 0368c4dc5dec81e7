"""OmegaConf resolvers the configs use to pick paths that every rank agrees on.

  ${project_root:}               the directory that holds conf/ and src/
  ${project_name:}               the package's name (the W&B project, for instance)
  ${run_id:}                     slurm-<job id>, torchrun-<rdzv id> or a timestamp
                                 (hpctrain.runtime.environment.launched.run_id)
  ${rank_zero_only:<value>}      <value> on global rank 0, null on the other ranks
  ${rank_zero_file:<path>}       <path> on global rank 0, os.devnull on the other ranks
  ${help_examples:<entry>}       the examples `python src/<entry>.py --help` ends with (help_text)

They are registered when the package is imported (`hpctrain/__init__.py`): a config rebuilt from a
pickle in another process (a SLURM job started by the submitit launcher) resolves them too.
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from omegaconf import OmegaConf

from hpctrain.runtime.config import help_text, versions
from hpctrain.runtime.environment import launched


@functools.cache
def cached_run_id() -> str:
    """Cached for the whole process: outside SLURM the id is a timestamp and must not tick over. (A named
    module-level function, so a config shipped to another process by pickle refers to it by name.)"""
    return launched.run_id()


def register_resolvers(project_root: Path) -> None:
    root = str(Path(project_root).resolve())
    resolvers = {
        "project_root": lambda: root,
        "project_name": lambda: __name__.split(".")[0],
        "run_id": cached_run_id,
        "rank_zero_only": lambda value: value if launched.is_rank_zero() else None,
        "rank_zero_file": lambda path: path if launched.is_rank_zero() else os.devnull,
        "help_examples": help_text.examples,
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name) or name == "project_root":
            versions.register_resolver(name, resolver)
