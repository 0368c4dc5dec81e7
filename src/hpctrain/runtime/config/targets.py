"""How the project's configs name the code a run builds: every `_target_` looked up as Hydra looks it up
(`locate`: `torch.nn.Linear`, `torch.optim.Adam`, a re-export, a classmethod such as
`LightningDataModule.from_datasets`), one that cannot be found said in one sentence with the name it most
likely means, and built by Hydra (`instantiate`).

Only the project's own configs and its command line name code: a received file never gives a `_target_`
(it proposes options and values, `hpctrain.runtime.config.proposals`). Hydra 1.4 adds a call-site
execution allowlist (`instantiate(..., _execution_whitelist_=...)`; without one it warns, and Hydra 1.5
will refuse): `instantiate` passes the node's own exact names where the installed Hydra has one. Hydra 1.4
also checks a factory's result when it is callable, by its class's name: an nn.Module is, so a function of
the project's that returns torchvision's ResNet needs `torchvision.*`; the packages of the template's stack
(RESULT_PACKAGES), hpctrain's and the project's are allowed for results. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hydra.utils
from hydra._internal.utils import _locate  # Hydra's own lookup (hpctrain.runtime.internals)
from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from hpctrain.runtime.config import target_spelling
from hpctrain.runtime.config.compose import project_packages
from hpctrain.runtime.errors import UserError

TARGET = "_target_"


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
    """The object `target` names, looked up as Hydra looks it up (module by module, then attribute by
    attribute), else one sentence (a misspelt name: the one it most likely means). Imports what it names:
    call it only for a name the project's configs or its command line give."""
    if not isinstance(target, str) or "." not in target:
        raise UserError(
            f"_target_: {target!r} is not the dotted name of a class or function (<module>.<name>, e.g. "
            "mypackage.models.Net); write the full path."
        )
    try:
        return _locate(target)
    except (ImportError, ValueError) as err:
        raise cannot_import(target, err.__cause__ or err) from err


# What the template's factories return (modules, metrics): Hydra 1.4 checks a callable result by its class
RESULT_PACKAGES = ("torch", "torchvision", "torchmetrics", "pytorch_lightning", "lightning")


def whitelist_supported() -> bool:
    """Whether the installed Hydra takes a call-site execution whitelist (1.4 and later)."""
    return hasattr(hydra.utils, "execution_whitelist")


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate for a config the project composed: every `_target_` in it located first (a
    name that cannot be found is one sentence), and, where Hydra has one, its exact names as Hydra's
    execution whitelist (with the results' packages, see the module docstring)."""
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig | ListConfig) else node
    names = {t for _, t in targets_in(plain) if isinstance(t, str)}
    names |= {t for _, t in targets_in(kwargs) if isinstance(t, str)}
    for name in sorted(names):
        locate(name)
    if not whitelist_supported():
        return hydra_instantiate(node, *args, **kwargs)
    packages = {f"{package}.*" for package in ("hpctrain", *project_packages(), *RESULT_PACKAGES)}
    return hydra_instantiate(node, *args, _execution_whitelist_=tuple(sorted(names | packages)), **kwargs)
