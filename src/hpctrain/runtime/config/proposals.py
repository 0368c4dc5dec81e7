"""A received file proposes, the project disposes: the one way every reader (eval, predict, export,
hpctrain.load) turns the config a checkpoint stores into the config it builds from.

A checkpoint of this template stores the options its training composed (`choices`: model=...,
model/net=..., data=..., experiment=...) and the resolved model, data and monitor values. They are a
proposal, never a config:

- **plain data first** (`plain`): JSON types only (dict, list, str, int, float, bool, None), at most
  `BUDGET` nodes, no node reached twice, strings cut at `MAX_TEXT`; nothing of the file reaches OmegaConf
  or Hydra as it comes;
- **options the project has**: each proposed option must be an option of the project's groups (Hydra
  says which are when it composes); the command line's choices win;
- **values at keys the composition has**: a value is taken where the composed config has the key, as a
  scalar (or a list of scalars) of a fitting type, unless the key is a path, a folder, a URL or an action
  (`is_place`: path, root, tokenizer, demo, download, `*_dir`, ...) or Hydra's (`_target_`, `_args_`,
  ...): those come from the command line or the project's own configs, never from the file;
- **what does not fit is one sentence** when it would change what is built (a class, a model value),
  naming the override to pass; a data value the composition does not take is said in one line.

No torch here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.config.compose import config_groups, group_options
from hpctrain.runtime.environment import launched
from hpctrain.runtime.errors import UserError

log = logging.getLogger("hpctrain")

GROUPS = ("model", "data", "monitor")  # the config a checkpoint stores and a reader takes from it
# the groups whose options a checkpoint records (and their subgroups)
CHOSEN = ("experiment", "model", "data")
BUDGET = 100_000  # nodes of a stored config: a model's config has hundreds
DEPTH = 64  # levels of a stored config: a model's config has a handful
MAX_TEXT = 4096  # characters of one stored string
PLACES = ("path", "root", "tokenizer", "demo", "download", "url", "uri", "chat_template")
PLACE_SUFFIXES = ("_dir", "_path", "_file", "_root", "_url", "_uri", "_files")
_NAME = re.compile(r"^[A-Za-z0-9_][\w.-]*$")  # an option's name: no path, no override syntax


class ProposalRefused(UserError):
    pass


@dataclass(frozen=True)
class Proposal:
    """What a file proposes: its options by group, and its values of the stored groups."""

    source: str  # how the file was given, for the sentences: "ckpt_path=<path>"
    choices: dict[str, str]
    values: dict[str, Any]


def plain(value: Any, source: str) -> Any:
    """`value` as JSON data (a copy), or one sentence: another type, more than `BUDGET` nodes or `DEPTH`
    levels, or a node reached twice (a file can share one node many levels deep and claim a vast tree in a
    few bytes)."""
    seen: set[int] = set()
    left = [BUDGET]

    def copy(node: Any, depth: int = 0) -> Any:
        left[0] -= 1
        if left[0] < 0 or depth > DEPTH:
            raise ProposalRefused(
                f"{source} stores a config of more than {BUDGET} values or {DEPTH} levels, which no config "
                "written by src/train.py holds; pass a checkpoint of this project."
            )
        if node is None or isinstance(node, bool | int | float):
            return node
        if isinstance(node, str):
            return node[:MAX_TEXT]
        if isinstance(node, dict | list):
            if id(node) in seen:
                raise ProposalRefused(
                    f"{source} stores a config whose parts are shared by reference, which no config written by "
                    "src/train.py holds; pass a checkpoint of this project."
                )
            seen.add(id(node))
            if isinstance(node, list):
                return [copy(v, depth + 1) for v in node]
            if not all(isinstance(k, str) for k in node):
                raise ProposalRefused(
                    f"{source} stores a config with keys that are not names; pass a checkpoint of this project."
                )
            return {k: copy(v, depth + 1) for k, v in node.items()}
        raise ProposalRefused(
            f"{source} stores a {type(node).__name__} in its config, where only plain values belong; pass a "
            "checkpoint of this project."
        )

    return copy(value)


def proposal_of(stored: Any, source: str) -> Proposal:
    """The proposal of a file's stored config (`{choices, model, data, monitor}`), checked for its shape."""
    stored = plain(stored, source)
    values = {g: stored[g] for g in GROUPS if g in stored} if isinstance(stored, dict) else None
    if values is None or not all(isinstance(v, dict) for v in values.values()):
        raise ProposalRefused(
            f"{source} holds something else where its config should be; pass a checkpoint written by this project."
        )
    choices = stored.get("choices") or {}
    if not isinstance(choices, dict) or not all(
        _is_group(group) and (option is None or (isinstance(option, str) and _NAME.match(option)))
        for group, option in choices.items()
    ):
        raise ProposalRefused(
            f"{source} records config options that are no group's option names; pass model=<option> data=<option>."
        )
    return Proposal(source, {g: o for g, o in choices.items() if o is not None}, values)


def _is_group(group: Any) -> bool:
    return (
        isinstance(group, str)
        and group.split("/")[0] in CHOSEN
        and all(_NAME.match(p) for p in group.split("/"))
    )


def is_place(key: str) -> bool:
    """Whether a dotted key names a path, a folder, a URL or an action (never taken from a file)."""
    last = key.rsplit(".", 1)[-1]
    return last in PLACES or last.endswith(PLACE_SUFFIXES)


def is_hydras(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return last.startswith("_") and last.endswith("_")


def choices_of(hydra_choices: Any) -> dict[str, str]:
    """What a checkpoint records of a run's options: Hydra's choices of the groups it proposes."""
    return {
        str(g): str(o) for g, o in dict(hydra_choices or {}).items() if _is_group(str(g)) and o is not None
    }


def composed(
    proposal: Proposal,
    command_line: Sequence[str],
    compose: Callable[[list[str]], DictConfig],
) -> DictConfig:
    """The project's own composition of what `proposal` proposes, the command line winning (`command_line`:
    its overrides of the stored groups, of the paths, the seed and the search path are taken):
    `compose(overrides)` composes src/train.py's config. Returns that config; its stored groups hold the
    file's values where they fit (see the module docstring)."""
    command_line = relevant(command_line)
    given = {_key(o).replace("/", ".") for o in command_line}
    options = proposal.choices or inferred_choices(proposal.values)
    overrides = [f"{g}={o}" for g, o in sorted(options.items()) if not _decided(g, given)]
    try:
        cfg = compose([*overrides, *command_line])
    except Exception as err:  # Hydra's: an option this project does not have
        named = " ".join(overrides) or "its options"
        reason = " ".join(str(err).split("Config search path")[0].split())[:160]
        raise ProposalRefused(
            f"{proposal.source} proposes {named}, which this project cannot compose ({reason}); choose the "
            "options yourself: model=<option> data=<option>."
        ) from err
    taken, unfit, places = [], [], []
    for group, values in proposal.values.items():
        keys = _flat_keys(cfg, group)
        for key, value in _leaves(values, group):
            if any(key == g or key.startswith(f"{g}.") for g in given):
                continue  # the command line decides it
            if key not in keys:
                unfit.append((key, value))
                continue
            now = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
            now = OmegaConf.to_container(now, resolve=True) if OmegaConf.is_config(now) else now
            if now == value:
                continue
            if is_place(key):
                places.append(key)
            elif is_hydras(key) or not _fits(value, now):
                unfit.append((key, value))
            else:
                taken.append((key, value))
    for key, value in taken:
        OmegaConf.update(cfg, key, value, merge=False)
    _refuse_what_changes_the_model(proposal.source, unfit)
    if places and launched.is_rank_zero():
        log.info(
            "%s: %s as this command gives (paths and actions never come from a file)",
            proposal.source,
            ", ".join(places),
        )
    return cfg


def inferred_choices(values: dict[str, Any]) -> dict[str, str]:
    """For a file that records no options (0.4's checkpoints): in each model and data group, the first
    option whose own `_target_` is the one the file stores at that place (options of one class differ in
    nothing the file's values do not give)."""
    found = {}
    for group in (g for g in config_groups() if g.split("/")[0] in ("model", "data")):
        node: Any = values
        for part in group.split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        target = node.get("_target_") if isinstance(node, dict) else None
        option = next(
            (o for o, path in group_options(group).items() if _target_of(path, group) == target), None
        )
        if target is not None and option is not None:
            found[group] = option
    return found


def _target_of(path: Path, group: str) -> Any:
    """The `_target_` a project's option file gives its group's node (read, not composed)."""
    text = path.read_text()
    node: Any = yaml.safe_load(text) or {}
    if re.search(r"^# @package _global_", text, flags=re.MULTILINE):
        for part in group.split("/"):
            node = node.get(part) if isinstance(node, dict) else None
    return node.get("_target_") if isinstance(node, dict) else None


def chosen(proposal: Proposal, command_line: Sequence[str]) -> dict[str, str]:
    """The options a composition of `proposal` takes: the file's, unless the command line chooses."""
    given = {_key(o): o.split("=", 1)[1] for o in relevant(command_line) if "=" in o and _is_group(_key(o))}
    options = proposal.choices or inferred_choices(proposal.values)
    decided = {g.replace("/", ".") for g in given}
    return {**{g: o for g, o in options.items() if not _decided(g, decided)}, **given}


def _decided(group: str, given: set[str]) -> bool:
    """Whether the command line chooses `group` (model/net) or a group above it (model=... decides its
    net, optimizer and scheduler too: the file's choices of a model the command did not pick never mix in)."""
    parts = group.split("/")
    return any(".".join(parts[: i + 1]) in given for i in range(len(parts)))


def _refuse_what_changes_the_model(source: str, unfit: list[tuple[str, Any]]) -> None:
    decisive = [(k, v) for k, v in unfit if k.startswith("model.") or is_hydras(k)]
    if not decisive:
        if unfit and launched.is_rank_zero():
            log.info(
                "%s: not taken from it (no such key here, or another type): %s",
                source,
                ", ".join(k for k, _ in unfit),
            )
        return
    shown = " ".join(f"{k}={_shown(v)}" for k, v in decisive[:4]) + (
        f" (and {len(decisive) - 4} more)" if len(decisive) > 4 else ""
    )
    raise ProposalRefused(
        f"{source} was trained with {shown}, which this project's configs do not give: a file's config proposes "
        f"values, never the code that runs or where it reads; if you trust that file and the code it names, pass "
        f"them on the command line (with + for a key the config lacks), or choose the options: model=<option>."
    )


def _shown(value: Any) -> str:
    text = str(value).replace(" ", "")
    return (
        text
        if len(text) <= 80 and text.isprintable()
        else text[:77].encode("ascii", "replace").decode() + "..."
    )


def relevant(command_line: Sequence[str]) -> list[str]:
    """The overrides of a command line that decide what a proposal is composed with."""
    return [
        o
        for o in command_line
        if _key(o) == "hydra.searchpath" or _key(o).split(".")[0].split("/")[0] in DECIDING
    ]


DECIDING = ("model", "data", "monitor", "experiment", "paths", "seed")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    return [(prefix, node)]


def _flat_keys(cfg: DictConfig, group: str) -> set[str]:
    node = OmegaConf.to_container(cfg[group], resolve=False) if OmegaConf.is_dict(cfg.get(group)) else None
    return {k for k, _ in _leaves(node, group)} if isinstance(node, dict) else set()


def _fits(value: Any, now: Any) -> bool:
    """Whether a file's value may take the composed value's place: both scalars of one kind (or lists of
    scalars), or one of them null; strings are text, never an interpolation."""
    if _interpolates(value):
        return False
    if value is None or now is None:
        return _scalar_or_scalars(value)
    kinds = (bool, int | float, str)
    if isinstance(value, list) and isinstance(now, list):
        return all(_scalar_or_scalars(v) and not isinstance(v, list) for v in value)
    return any(isinstance(value, k) and isinstance(now, k) for k in kinds) and isinstance(
        value, bool
    ) == isinstance(now, bool)


def _scalar_or_scalars(value: Any) -> bool:
    return all(
        v is None or (isinstance(v, bool | int | float | str) and not _interpolates(v))
        for v in (value if isinstance(value, list) else [value])
    )


def _interpolates(value: Any) -> bool:
    return isinstance(value, str) and ("${" in value or value == "???")
