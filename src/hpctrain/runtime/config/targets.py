"""Which code a run may build: one rule for every `_target_`, enforced here and nowhere else.

1. **A file's targets are a closed set of exact names** (`check_stored`). A config read from a file
   (a checkpoint's stored model and data config, an export's metadata) may name only a `_target_` that
   appears verbatim in the configs this project composes: every `_target_:` of the YAML files Hydra
   reads (conf/, hpctrain's groups, a `hydra.searchpath` folder), this command line's overrides, or the
   user's `checkpoints.trusted_targets`. A name is compared as a string, before anything is imported:
   no prefix, no package, no pattern.
2. **A target is one attribute of one module** (`resolve`), the project's own configs' included: the
   module part is imported, and one attribute (or one attribute of a class) is taken from it, which must
   be defined there (`obj.__module__` is that module) or be a public name the module declares (its
   `__all__`, as `torch.optim` declares `AdamW`; a moved name its module's `__getattr__` keeps). Hydra
   resolves a dotted name attribute by attribute, so to a prefix check
   `<package>.<a module that imports torch>.torch.hub.load` is "the package's"; here it is no module's
   attribute at all. Hydra's own lookup must then give the very same object.
3. **A file's strings stay text**: `build_stored` builds a checked file's config from plain containers,
   with no OmegaConf (so no interpolation, no resolver) on it at all.

Hydra 1.4 adds a call-site execution allowlist (`instantiate(..., _execution_whitelist_=...)`; without one
it warns, and Hydra 1.5 will refuse): `instantiate` passes the node's own exact names where the installed
Hydra has one. Hydra 1.4 also checks a factory's result when it is callable, by its class's name: an
nn.Module is, so a function of the project's that returns torchvision's ResNet needs `torchvision.*`;
the packages of the template's stack (RESULT_PACKAGES), hpctrain's and the project's are allowed for
results. The names themselves were decided above. No torch here.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import hydra.utils
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object
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


# --------------------------------------------------------------------------- rule 2: one attribute


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


def _module(name: str) -> types.ModuleType | None:
    """The module of that exact dotted name, imported; None when no module has that name."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(f"{err.name}.")):
            return None  # the name itself (or a package above it) is not a module
        raise  # the module exists, but something it imports is missing


def _declared(module: types.ModuleType, name: str) -> bool:
    """Whether `module` declares `name` public though another module defines it: its `__all__`, or a name
    its module-level `__getattr__` (PEP 562: a moved name) answers."""
    if name in (getattr(module, "__all__", None) or ()):
        return True
    return name not in vars(module) and "__getattr__" in vars(module)


def _walk_refusal(target: str, owner: str, name: str, obj: Any) -> UserError:
    if isinstance(obj, types.ModuleType):
        held, fix = f"the module {obj.__name__}", "name the class or function by the module that defines it"
    else:
        defined = getattr(obj, "__module__", None) or type(obj).__module__
        qualified = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", name)
        held, fix = f"{defined}.{qualified}, imported", f"write `_target_: {defined}.{qualified}`"
    return UntrustedTarget(
        f"_target_: {target} is not a name {owner} defines ({name} there is {held}): a target is one "
        f"attribute of one module, never followed through the modules another one imports; {fix}."
    )


def resolve(target: str) -> Any:
    """Rule 2: the object `target` names, as one attribute of one module (or one attribute of a class
    that module defines), else one sentence. Imports the module part (only call it for a name the
    project's configs give, or one `check_stored` admitted)."""
    parts = target.split(".") if isinstance(target, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise UntrustedTarget(
            f"_target_: {target!r} is not the dotted name of a module's class or function "
            "(<module>.<name>, e.g. mypackage.models.Net); write the full path."
        )
    for cut in (len(parts) - 1, len(parts) - 2):  # module.name, then module.Class.name
        if cut < 1:
            break
        module_name = ".".join(parts[:cut])
        try:
            module = _module(module_name)
        except ModuleNotFoundError as err:
            raise cannot_import(target, err) from err
        if module is None:
            continue
        name, rest = parts[cut], parts[cut + 1 :]
        if not hasattr(module, name):
            close = target_spelling.closest_target(target)
            raise UserError(
                f"_target_: {target} cannot be imported: module {module_name} has no {name}; "
                + (
                    f"did you mean {close}?"
                    if close
                    else "check the spelling of the class or function name in the config."
                )
            )
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType) or not (
            getattr(obj, "__module__", None) == module.__name__ or _declared(module, name)
        ):
            raise _walk_refusal(target, module_name, name, obj)
        if rest:  # one attribute of a class the module defines (Class.from_config)
            if not isinstance(obj, type) or not hasattr(obj, rest[0]):
                raise UserError(
                    f"_target_: {target} cannot be imported: {module_name}.{name} has no attribute {rest[0]}; "
                    "check the spelling of the name in the config."
                )
            obj = getattr(obj, rest[0])
            if isinstance(obj, types.ModuleType):
                raise _walk_refusal(target, f"{module_name}.{name}", rest[0], obj)
        return obj
    try:
        top = _module(parts[0])
    except ModuleNotFoundError as err:
        raise cannot_import(target, err) from err
    if top is None:
        raise cannot_import(target, ModuleNotFoundError(f"No module named {parts[0]!r}", name=parts[0]))
    raise _not_a_module_attribute(target, parts)


def _not_a_module_attribute(target: str, parts: list[str]) -> UntrustedTarget:
    """The sentence for a name whose module part is no module: the longest module above it, and what
    it holds under the next part (another module, most often: the walk Hydra would take)."""
    for cut in range(len(parts) - 2, 0, -1):
        module = _module(".".join(parts[:cut]))
        if module is not None and hasattr(module, parts[cut]):
            return _walk_refusal(target, module.__name__, parts[cut], getattr(module, parts[cut]))
        if module is not None:
            break
    return UntrustedTarget(
        f"_target_: {target} is not an attribute of a module (no module is named {'.'.join(parts[:-1])}); "
        "write <module>.<name> for a class or function the module defines."
    )


def resolved_for_hydra(target: str) -> Any:
    """`resolve(target)`, which Hydra's own lookup of the same string must give too (a package that
    rebinds the name of one of its modules would send Hydra elsewhere)."""
    obj = resolve(target)
    if get_object(target) is not obj:
        raise UntrustedTarget(
            f"_target_: {target} leads Hydra's attribute-by-attribute lookup to another object than the one "
            "its module defines under that name; name the object by the module that defines it."
        )
    return obj


# --------------------------------------------------------------------------- building


def build_stored(node: Any) -> Any:
    """A config read from a file, built as Hydra would build it with `_convert_="all"` (`_target_`,
    `_args_`, `_partial_`, `_recursive_`), from plain containers: its strings are text, with no OmegaConf
    and so no interpolation on them at all. Check it with `check_stored` first; every target is resolved
    by rule 2. The classes get copies of the values (they cannot change what was read)."""
    if isinstance(node, Mapping):
        if TARGET not in node:
            return {key: build_stored(value) for key, value in node.items()}
        target = resolve(node[TARGET])
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
    `_target_` in it resolved by rule 2 first, and, where Hydra has one, its exact names as Hydra's
    execution whitelist (with the results' packages, see the module docstring)."""
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig | ListConfig) else node
    names = {t for _, t in targets_in(plain) if isinstance(t, str)}
    names |= {t for _, t in targets_in(kwargs) if isinstance(t, str)}
    for name in sorted(names):
        resolved_for_hydra(name)
    if not whitelist_supported():
        return hydra_instantiate(node, *args, **kwargs)
    packages = {f"{package}.*" for package in ("hpctrain", *project_packages(), *RESULT_PACKAGES)}
    return hydra_instantiate(node, *args, _execution_whitelist_=tuple(sorted(names | packages)), **kwargs)
