"""Which code a run may build: the `_target_`s of the project's own configs, never one a file names.

A checkpoint keeps the model and data config it was trained with, so that eval, predict, export and
`hpctrain.load` rebuild the same model. That config is data, in a file anyone can send: its values are
used, but the classes it names are not taken on its word. Every `_target_` in it must be one that the
project's configs name (every `_target_:` in the YAML files Hydra composes from: conf/, hpctrain's own
groups, and a `hydra.searchpath` folder given on the command line), a class of the project's own
package (src/<package>/: code the user wrote), or one the user lists in `checkpoints.trusted_targets`;
any other is refused in one sentence before anything is imported. Its
strings are literals: an interpolation in them (`${...}`) is not resolved, so no resolver runs on them.

Hydra 1.4 adds a call-site execution whitelist (`instantiate(..., _execution_whitelist_=...)`; without
one it warns, and Hydra 1.5 will refuse): `instantiate` passes the targets it was given, hpctrain's and the
project's packages, where the installed Hydra has one. Hydra 1.4 also checks a factory's result when it
is callable, by its class's name: an nn.Module is, so a function of the project's that returns
torchvision's ResNet needs `torchvision.*`. The packages of the template's stack (RESULT_PACKAGES) are
therefore allowed too; the node's targets themselves were decided above (composed by the project, or a
file's checked by `check_stored`). No torch here.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from hpctrain.runtime.config.compose import CONF_DIR, config_dirs
from hpctrain.runtime.errors import UserError

TARGET = "_target_"
TRUSTED_KEY = "checkpoints.trusted_targets"


class UntrustedTarget(UserError):
    pass


def targets_in(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key of the node, its `_target_`) for every `_target_` in a plain config (dicts, lists)."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, Mapping):
        if TARGET in node:
            found.append((prefix, node[TARGET]))
        for key, value in node.items():
            found += targets_in(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            found += targets_in(value, f"{prefix}[{i}]")
    return found


def _yaml_targets(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in sorted(folder.rglob("*.yaml")):
        try:
            documents = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError):
            continue  # Hydra says what is wrong with it when it composes it
        for document in documents:
            names.update(t for _, t in targets_in(document) if isinstance(t, str) and "${" not in t)
    return names


@functools.cache
def _targets_of(folders: tuple[Path, ...]) -> frozenset[str]:
    return frozenset().union(*(_yaml_targets(f) for f in folders if f.is_dir()))


def _search_path_folders() -> list[Path]:
    """The folders of the running Hydra app's config search path (file:// and pkg:// sources), if any."""
    from hydra.core.hydra_config import (
        HydraConfig,  # Hydra waits: a stored answer (answers) is printed before it is imported
    )

    try:
        sources = HydraConfig.get().runtime.config_sources
    except Exception:  # not inside a Hydra app (hpctrain.load from a notebook)
        return []
    folders = []
    for source in sources:
        schema, path = source.get("schema"), source.get("path")
        if schema == "file" and path:
            folders.append(Path(path))
        elif schema == "pkg" and path:
            spec = importlib.util.find_spec(path.replace("/", "."))
            if spec is not None and spec.submodule_search_locations:
                folders += [Path(p) for p in spec.submodule_search_locations]
    return folders


def project_targets() -> frozenset[str]:
    """Every `_target_` the project's configs name (see the module docstring)."""
    folders = {p.resolve() for p in (*config_dirs(), *_search_path_folders())}
    return _targets_of(tuple(sorted(folders)))


@functools.cache
def project_packages() -> tuple[str, ...]:
    """The project's own packages (src/<package>/, hpctrain and Hydra's plugins aside): code the user wrote,
    whose classes a checkpoint's config may name whether or not a config file does."""
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


def trusted(extra: Iterable[str] | None = None) -> frozenset[str]:
    """The targets a config read from a file may name: the project's, and those the user trusts."""
    return project_targets() | frozenset(str(t) for t in (extra or ()))


def _allowed(target: str, allowed: frozenset[str]) -> bool:
    return target in allowed or any(target.startswith(f"{package}.") for package in project_packages())


def check_stored(
    stored: Mapping[str, Any],
    source: str,
    extra: Iterable[str] | None = None,
    how: str = "",
    searchpath: str = "",
) -> None:
    """Refuse a config read from a file (`source`, e.g. "ckpt_path=<path>") that names a `_target_` the
    project's configs do not (nor `extra`, the user's trusted targets); `how`: how to trust one;
    `searchpath`: the `hydra.searchpath=...` the training run recorded, whose configs would name it."""
    allowed = trusted(extra)
    for key, target in targets_in(stored):
        if isinstance(target, str) and _allowed(target, allowed):
            continue
        where = f"{key}._target_" if key else TARGET
        allow = how or f"{TRUSTED_KEY}=[{target}]"
        again = f"pass the configs its training run searched again ({searchpath}), " if searchpath else ""
        raise UntrustedTarget(
            f"{source} stores {where}={target!r}, which no config of this project names: a file's config gives "
            f"values, never the code that runs, so nothing was built from it; if you trust that file and the code "
            f"it names, allow it with {allow}, {again}or build this project's own model with model=<option>."
        )


def literal(node: Any) -> Any:
    """`node` with every string made a literal for OmegaConf (`${` escaped): nothing in it resolves."""
    if isinstance(node, Mapping):
        return {key: literal(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [literal(value) for value in node]
    if isinstance(node, str) and "${" in node:
        return node.replace("${", "\\${")
    return node


# What the template's factories return (modules, metrics): Hydra 1.4 checks a callable result by its class
RESULT_PACKAGES = ("torch", "torchvision", "torchmetrics", "pytorch_lightning", "lightning")


def whitelist_supported() -> bool:
    """Whether the installed Hydra takes a call-site execution whitelist (1.4 and later)."""
    import hydra.utils  # Hydra waits: a stored answer (answers) is printed before it is imported

    return hasattr(hydra.utils, "execution_whitelist")


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with the node's own targets as Hydra's execution whitelist where Hydra
    has one. Only for configs the project composed (or checked with `check_stored`)."""
    from hydra.utils import (
        instantiate as hydra_instantiate,  # Hydra waits: a stored answer (answers) is printed before it is imported
    )

    if not whitelist_supported():
        return hydra_instantiate(node, *args, **kwargs)
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig | ListConfig) else node
    names = {t for _, t in targets_in(plain) if isinstance(t, str)}
    names |= {t for _, t in targets_in(kwargs) if isinstance(t, str)}
    packages = {f"{package}.*" for package in ("hpctrain", *project_packages(), *RESULT_PACKAGES)}
    return hydra_instantiate(node, *args, _execution_whitelist_=tuple(sorted(names | packages)), **kwargs)
