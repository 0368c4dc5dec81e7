"""Which code a run may build: one rule for a file's `_target_`s, and the project's own resolved as Hydra does.

1. **A file's targets are a closed set of exact names** (`check_stored`). A config read from a file
   (a checkpoint's stored model and data config, an export's metadata) may name only a `_target_` that
   appears verbatim in the configs this project composes: every `_target_:` of the YAML files Hydra
   reads (conf/, hpctrain's groups, a `hydra.searchpath` folder), this command line's overrides, or the
   user's `checkpoints.trusted_targets`. A name is compared as a string, before anything is imported:
   no prefix, no package, no pattern. So a file reaches no further than the user's own configs do.
2. **The project's own configs are trusted code**: a target there (and so one a file repeats exactly) is
   looked up as Hydra looks it up (`locate`: `torch.nn.Linear`, `torch.optim.Adam`, a re-export, a
   classmethod such as `LightningDataModule.from_datasets`); one that cannot be found is one sentence
   with the name it most likely means.
3. **A file's strings stay text**: `build_stored` builds a checked file's config from plain containers,
   with no OmegaConf (so no interpolation, no resolver) on it at all.

Hydra 1.4 adds a call-site execution allowlist (`instantiate(..., _execution_whitelist_=...)`; without one
it warns, and Hydra 1.5 will refuse): `instantiate` passes the node's own exact names where the installed
Hydra has one. Hydra 1.4 also checks a factory's result when it is callable, by its class's name: an
nn.Module is, so a function of the project's that returns torchvision's ResNet needs `torchvision.*`;
the packages of the template's stack (RESULT_PACKAGES), hpctrain's and the project's are allowed for
results. No torch here.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import hydra.utils
import yaml
from hydra._internal.utils import _locate  # Hydra's own lookup (hpctrain.runtime.internals)
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from hpctrain.runtime.config import target_spelling
from hpctrain.runtime.config.compose import config_dirs, project_packages
from hpctrain.runtime.errors import UserError

TARGET = "_target_"
TRUSTED_KEY = "checkpoints.trusted_targets"
# Hydra's keys of a node besides its arguments (`build_stored` honours them as Hydra does)
_ARGS, _PARTIAL, _RECURSIVE, _CONVERT = "_args_", "_partial_", "_recursive_", "_convert_"


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


# --------------------------------------------------------------------------- rule 1: the closed set


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


def _hydra_config() -> Any:
    """The running Hydra app's config (None outside one: hpctrain.load from a notebook)."""
    try:
        return HydraConfig.get()
    except Exception:
        return None


def _search_path_folders() -> list[Path]:
    """The folders of the running Hydra app's config search path (file:// and pkg:// sources), if any."""
    hydra_cfg = _hydra_config()
    if hydra_cfg is None:
        return []
    folders = []
    for source in hydra_cfg.runtime.config_sources:
        schema, path = source.get("schema"), source.get("path")
        if schema == "file" and path:
            folders.append(Path(path))
        elif schema == "pkg" and path:
            spec = importlib.util.find_spec(path.replace("/", "."))
            if spec is not None and spec.submodule_search_locations:
                folders += [Path(p) for p in spec.submodule_search_locations]
    return folders


def project_targets() -> frozenset[str]:
    """Every `_target_` the project's config files name (conf/, hpctrain's groups, a hydra.searchpath)."""
    folders = {p.resolve() for p in (*config_dirs(), *_search_path_folders())}
    return _targets_of(tuple(sorted(folders)))


# `model.net._target_=x.Y`, `+model.net={_target_: x.Y}`: a name the command line gives a `_target_`
_COMMAND_LINE_TARGET = re.compile(r"(?:^|[.{,\s])_target_\s*[=:]\s*['\"]?([A-Za-z_][\w.]*)")


def command_line_targets() -> frozenset[str]:
    """The `_target_` names this process's command line gives (its Hydra overrides), if in a Hydra app."""
    hydra_cfg = _hydra_config()
    if hydra_cfg is None:
        return frozenset()
    task = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False) or []
    return frozenset(m for override in task for m in _COMMAND_LINE_TARGET.findall(str(override)))


def closed_set(extra: Iterable[str] | None = None) -> frozenset[str]:
    """The exact names a config read from a file may give `_target_`: the project's configs', this command
    line's, and `extra` (the user's `checkpoints.trusted_targets`)."""
    return project_targets() | command_line_targets() | frozenset(str(t) for t in (extra or ()))


def refusal(source: str, where: str, target: Any, how: str = "", searchpath: str = "") -> UntrustedTarget:
    """The sentence for a file's `_target_` outside the closed set; `searchpath`: the `hydra.searchpath=...`
    the training run recorded, whose configs would name it (shown as words to type, never used)."""
    allow = how or f"{TRUSTED_KEY}=[{target}]"
    again = f"pass the configs its training run searched again ({searchpath}), " if searchpath else ""
    return UntrustedTarget(
        f"{source} stores {where}={target!r}, which no config of this project names: a file's config gives "
        f"values, never the code that runs, so nothing was built from it; if you trust that file and the code "
        f"it names, allow it with {allow}, {again}or build this project's own model with model=<option>."
    )


def check_stored(
    stored: Mapping[str, Any],
    source: str,
    extra: Iterable[str] | None = None,
    how: str = "",
    searchpath: str = "",
    allowed: frozenset[str] | None = None,
) -> None:
    """Rule 1, for a config read from a file (`source`, e.g. "ckpt_path=<path>"): every `_target_` in it,
    at any depth, must be a string of the closed set (`closed_set(extra)`, or `allowed` when the caller
    has it), else one sentence (`how`: how to trust one; `searchpath`: see `refusal`). Nothing is imported."""
    allowed = closed_set(extra) if allowed is None else allowed
    for key, target in targets_in(stored):
        if not (isinstance(target, str) and target in allowed):
            raise refusal(source, f"{key}._target_" if key else TARGET, target, how, searchpath)


# --------------------------------------------------------------------------- rule 2: as Hydra looks it up


def cannot_import(target: str, missing: BaseException) -> UserError:
    """The one sentence for a `_target_` whose module cannot be imported: written with the `lightning`
    package where it is not installed, a misspelt path (the name it most likely means), or a package
    that is not on the path."""
    if (getattr(missing, "name", None) or "").split(".")[0] == "lightning":  # `import lightning as L`
        return UserError(
            f"_target_: {target} cannot be imported: it is written with the `lightning` package ({missing}), "
            "which is not installed here; install it beside pytorch-lightning, the same version "
            "(pip install 'lightning>=2.6,<2.7', as pyproject.toml lists it), or import pytorch_lightning instead."
        )
    close = target_spelling.closest_target(target)
    if close:
        return UserError(
            f"_target_: {target} cannot be imported ({type(missing).__name__}: {missing}); did you mean {close}?"
        )
    return UserError(
        f"_target_: {target} cannot be imported ({type(missing).__name__}: {missing}); put the package that "
        "holds it on PYTHONPATH (PYTHONPATH=/path/to/its/parent python src/train.py ...), install it "
        "(pip install -e <its project>), or move it into this project's src/ (the docs' guide: Your model)."
    )


def locate(target: Any) -> Any:
    """Rule 2: the object `target` names, looked up as Hydra looks it up (module by module, then attribute
    by attribute), else one sentence (a misspelt name: the one it most likely means). Imports what it
    names: call it only for a name the project's configs give, or one `check_stored` admitted."""
    if not isinstance(target, str) or "." not in target:
        raise UserError(
            f"_target_: {target!r} is not the dotted name of a class or function (<module>.<name>, e.g. "
            "mypackage.models.Net); write the full path."
        )
    try:
        return _locate(target)
    except (ImportError, ValueError) as err:
        raise cannot_import(target, err.__cause__ or err) from err


# --------------------------------------------------------------------------- building


def build_stored(node: Any) -> Any:
    """A config read from a file, built as Hydra would build it with `_convert_="all"` (`_target_`,
    `_args_`, `_partial_`, `_recursive_`), from plain containers: its strings are text, with no OmegaConf
    and so no interpolation on them at all. Check it with `check_stored` first; every target is resolved
    by rule 2. The classes get copies of the values (they cannot change what was read)."""
    if isinstance(node, Mapping):
        if TARGET not in node:
            return {key: build_stored(value) for key, value in node.items()}
        target = locate(node[TARGET])
        recursive = node.get(_RECURSIVE, True) is not False
        args = list(node.get(_ARGS) or [])
        kwargs = {k: v for k, v in node.items() if k not in (TARGET, _ARGS, _PARTIAL, _RECURSIVE, _CONVERT)}
        if recursive:
            args = [build_stored(a) for a in args]
            kwargs = {k: build_stored(v) for k, v in kwargs.items()}
        else:
            args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
        if node.get(_PARTIAL) is True:
            return functools.partial(target, *args, **kwargs)
        return target(*args, **kwargs)
    if isinstance(node, list | tuple):
        return [build_stored(value) for value in node]
    return copy.deepcopy(node)


# What the template's factories return (modules, metrics): Hydra 1.4 checks a callable result by its class
RESULT_PACKAGES = ("torch", "torchvision", "torchmetrics", "pytorch_lightning", "lightning")


def whitelist_supported() -> bool:
    """Whether the installed Hydra takes a call-site execution whitelist (1.4 and later)."""
    return hasattr(hydra.utils, "execution_whitelist")


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate for a config the project composed (or one `check_stored` admitted): every
    `_target_` in it located first (a name that cannot be found is one sentence), and, where Hydra has one,
    its exact names as Hydra's execution whitelist (with the results' packages, see the module docstring)."""
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig | ListConfig) else node
    names = {t for _, t in targets_in(plain) if isinstance(t, str)}
    names |= {t for _, t in targets_in(kwargs) if isinstance(t, str)}
    for name in sorted(names):
        locate(name)
    if not whitelist_supported():
        return hydra_instantiate(node, *args, **kwargs)
    packages = {f"{package}.*" for package in ("hpctrain", *project_packages(), *RESULT_PACKAGES)}
    return hydra_instantiate(node, *args, _execution_whitelist_=tuple(sorted(names | packages)), **kwargs)
