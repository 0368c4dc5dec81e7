"""The import paths machinery modules had before they moved under `hpctrain.runtime`, kept working.

A user's config or code may name `hpctrain.callbacks.ModelCheckpoint` or `from hpctrain.errors import
UserError`; importing an old path gives the very module at its new home (the same classes, so
`isinstance` holds). New code and the template's own configs use the new paths. No torch import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

MOVED = {
    "hpctrain.build": "hpctrain.runtime.run.build",
    "hpctrain.callbacks": "hpctrain.runtime.run.callbacks",
    "hpctrain.checkpointing": "hpctrain.runtime.run.checkpoints.contents",
    "hpctrain.cluster": "hpctrain.runtime.cluster",
    "hpctrain.command_line": "hpctrain.runtime.config.command_line",
    "hpctrain.config": "hpctrain.runtime.config.compose",
    "hpctrain.config_checks": "hpctrain.runtime.config.checks",
    "hpctrain.console": "hpctrain.runtime.report.console",
    "hpctrain.errors": "hpctrain.runtime.errors",
    "hpctrain.evaluation": "hpctrain.runtime.run.checkpoints.contents",
    "hpctrain.launch": "hpctrain.runtime.distributed.launch",
    "hpctrain.loggers": "hpctrain.runtime.run.loggers",
    "hpctrain.outputs": "hpctrain.runtime.run.records",
    "hpctrain.plots": "hpctrain.runtime.report.plots",
    "hpctrain.progress": "hpctrain.runtime.report.progress",
    "hpctrain.requeue": "hpctrain.runtime.distributed.requeue",
    "hpctrain.resolvers": "hpctrain.runtime.config.resolvers",
    "hpctrain.schema": "hpctrain.runtime.config.schema",
    "hpctrain.signals": "hpctrain.runtime.distributed.signals",
    "hpctrain.sweeps": "hpctrain.runtime.sweeps",
    "hpctrain.sweeps.grid": "hpctrain.runtime.sweeps.grid",
    "hpctrain.sweeps.jobs": "hpctrain.runtime.run.job",
    "hpctrain.sweeps.optuna_sweeper": "hpctrain.runtime.sweeps.optuna_sweeper",
    "hpctrain.sweeps.slurm": "hpctrain.runtime.sweeps.slurm",
    "hpctrain.sweeps.summary": "hpctrain.runtime.sweeps.summary",
    "hpctrain.watchdog": "hpctrain.runtime.distributed.watchdog",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in MOVED and hands out the module at its new path under the old name too."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):  # type: ignore[override]
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: object) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # The import system returns whatever sys.modules holds under the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())  # before the path finder, or a second copy would load
