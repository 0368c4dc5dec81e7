"""What a `_target_` that cannot be imported most likely misspells (`mylab.models.mymodl.MyModel`:
`mylab.models.mymodel.MyModel`), for the sentence that reports it.

Each dotted part is looked up among the names the part before it holds: the project's own packages first
(src/<package>/), then a package's modules and the names a module's source defines or imports at its top
level. A module's source is read, not imported (finding it imports its parent packages, which Hydra's
own attempt to import the target did already); a part that matches no name closely ends the search with
no suggestion. No torch here.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import pkgutil
import sys
from pathlib import Path

from hpctrain.runtime.config.compose import project_packages


def _spec(dotted: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(dotted)
    except (ImportError, ValueError):  # a part that is a class, or a parent that does not import
        return None


def _top_level_names(source: str | None) -> set[str]:
    """The classes, functions, assignments and imports at the top level of a module's source file."""
    if not source or not source.endswith(".py"):
        return set()
    try:
        tree = ast.parse(Path(source).read_text())
    # SystemError: CPython 3.11's spurious "recursion depth mismatch" (python/cpython#106905); the
    # sentence that reports the target then stands without a suggestion
    except (OSError, SyntaxError, ValueError, SystemError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _names_under(parts: list[str]) -> set[str] | None:
    """The names `a.b.<name>` can continue `parts` with, or None where that cannot be read (under a class)."""
    spec = _spec(".".join(parts))
    if spec is None:
        return None
    names = _top_level_names(spec.origin)
    imported = sys.modules.get(".".join(parts))  # a package that re-exports with `import *` (torch.nn)
    if imported is not None:
        names |= set(dir(imported))
    if spec.submodule_search_locations:
        names |= {module.name for module in pkgutil.iter_modules(spec.submodule_search_locations)}
    return names


def closest_target(target: str) -> str | None:
    """The importable dotted name closest to `target`, part by part, or None (nothing close, or `target`
    itself resolves as far as its sources tell)."""
    parts = target.split(".")
    fixed = list(parts)
    for i, part in enumerate(parts):
        if i == 0:
            if _spec(part) is not None:
                continue
            names: set[str] | None = set(project_packages())
        else:
            names = _names_under(fixed[:i])
        if names is None:
            break  # below a class: Hydra says what is wrong there
        if part in names:
            continue
        close = difflib.get_close_matches(part, sorted(names), n=1, cutoff=0.6)
        if not close:
            return None
        fixed[i] = close[0]
    return ".".join(fixed) if fixed != parts else None
