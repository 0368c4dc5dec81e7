"""Old import paths of names that moved, kept working for one minor version with a FutureWarning.

Projects carry copies of the shipped YAML, so a `_target_` such as
`hpctrain.runtime.run.callbacks.ModelCheckpoint` lives on in configs the template no longer controls.
The module that held the name keeps a module-level `__getattr__` (PEP 562) made here: Hydra's
`_target_` lookup and a plain `from old.module import Name` both reach the new home, and the warning
names the path to write instead. FutureWarning, not DeprecationWarning: Python shows it to the
user who runs the config, not only to a test runner.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.5"  # the old paths go one minor version after the move (0.4)


def moved_names(old_module: str, new_homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `old_module`: name -> "new.module.Name", each warned about once per use."""

    def __getattr__(name: str) -> Any:
        new = new_homes.get(name)
        if new is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(
            f"{old_module}.{name} moved to {new}; write `_target_: {new}` (or import it from there): "
            f"the old path goes in hpctrain {REMOVED_IN}.",
            FutureWarning,
            stacklevel=2,
        )
        module, _, attribute = new.rpartition(".")
        # imported on use: the new home may sit in a layer above the old module (see tests/test_layout.py)
        return getattr(importlib.import_module(module), attribute)

    return __getattr__
