"""Old import paths of names that moved, kept working for one minor version with a FutureWarning.

Projects carry copies of the shipped YAML, so a `_target_` such as
`hpctrain.runtime.run.callbacks.ModelCheckpoint` lives on in configs the template no longer controls.
The module that held the name keeps a module-level `__getattr__` (PEP 562) made here: Hydra's
`_target_` lookup and a plain `from old.module import Name` both reach the new home, and the warning
names the path to write instead; a whole module that moved keeps its old path the same way
(`moved_module`), its submodules included. FutureWarning, not DeprecationWarning: Python shows it to the
user who runs the config, not only to a test runner.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
        _warn(f"{old_module}.{name}", new)
        module, _, attribute = new.rpartition(".")
        # imported on use: the new home may sit in a layer above the old module (see tests/test_layout.py)
        return getattr(importlib.import_module(module), attribute)

    return __getattr__


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; write `_target_: {new}` (or import it from there): "
        f"the old path goes in hpctrain {REMOVED_IN}.",
        FutureWarning,
        stacklevel=3,
    )


def moved_module(
    old_module: str, new_module: str, renamed: dict[str, str] | None = None
) -> Callable[[str], Any]:
    """A module `__getattr__` for `old_module`, whose code now lives in `new_module`: its names, and
    `old_module.sub` imported as `new_module.sub` (`renamed` maps a submodule to its new name), the very
    same module objects, so a class stays one class whichever path a project's code or a stored
    config names."""
    sys.meta_path.append(_MovedSubmodules(old_module, new_module, renamed or {}))

    def __getattr__(name: str) -> Any:
        new = importlib.import_module(new_module)
        # the import system's own questions (__path__) are no moves; a submodule not imported yet is the finder's
        if name.startswith("__") or not hasattr(new, name):
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        _warn(f"{old_module}.{name}", f"{new_module}.{name}")
        return getattr(new, name)

    return __getattr__


class _MovedSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `old.sub` as the module `new.sub` already is (or becomes), with the warning."""

    def __init__(self, old: str, new: str, renamed: dict[str, str]) -> None:
        self.old, self.new, self.renamed = old, new, renamed

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(self.old + "."):
            return None
        first, _, rest = fullname[len(self.old) + 1 :].partition(".")
        new = ".".join(filter(None, (self.new, self.renamed.get(first, first), rest)))
        if importlib.util.find_spec(new) is None:  # never there: the old name's ModuleNotFoundError
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=new)

    def create_module(self, spec: Any) -> Any:
        _warn(spec.name, spec.origin)
        return importlib.import_module(spec.origin)

    def exec_module(self, module: Any) -> None:
        """The module ran as it was imported under its new name."""
