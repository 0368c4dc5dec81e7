"""A config node's keys checked against the signature of the class or function its `_target_` names,
before anything is built from it.

Hydra passes a node's keys as keyword arguments, and for `_partial_: true` (an optimizer, a schedule)
it only wraps them in functools.partial: a key the class does not take fails when the module calls it,
as a TypeError inside configure_optimizers. The usual cause is a group option swapped under an
experiment written for another one (an experiment's SGD `momentum` left for `model/optimizer=adamw`).
Targets that take `**kwargs`, or whose signature Python cannot read, are left to themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.errors import UserError


def check_arguments(node: DictConfig, key: str) -> None:
    """Refuse, in one sentence, a key of `node` (or of a node inside it) that its target does not take."""
    plain = OmegaConf.to_container(node, resolve=True)
    for path, entry in _targets(plain, key):
        try:
            target = get_object(entry["_target_"])
            parameters = inspect.signature(target).parameters.values()
        except (
            Exception
        ):  # unimportable targets are said when the node is built; C functions have no signature
            continue
        if any(p.kind is p.VAR_KEYWORD for p in parameters) or "_args_" in entry:
            continue
        taken = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [name for name in entry if not name.startswith("_") and name not in taken]
        if not unknown:
            continue
        several = len(unknown) > 1
        named = " and ".join(f"{path}.{name}={entry[name]}" for name in unknown)
        are_not = "are not arguments" if several else "is not an argument"
        target, takes = entry["_target_"], ", ".join(taken)
        removals = " ".join(f"~{path}.{name}" for name in unknown)
        them, kind = ("them" if several else "it"), path.rsplit(".", 1)[-1]
        raise UserError(
            f"{named} {are_not} of {target} (it takes {takes}); remove {them} ({removals}: an experiment or "
            f"option written for another {kind} may set {them}), or choose one that takes {them}."
        )


def _targets(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield path, node
        for name, value in node.items():
            yield from _targets(value, f"{path}.{name}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _targets(value, f"{path}[{index}]")
