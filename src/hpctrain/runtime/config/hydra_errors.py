"""Hydra's composition mistakes as one sentence: an unknown key or group option (with the closest valid
one), an override it cannot parse, a run dir it cannot create (`describe_hydra_error`, used by
`command_line`)."""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from hpctrain.runtime.config import redact
from hpctrain.runtime.config.compose import compose, config_groups, group_options
from hpctrain.runtime.errors import UserError


def _command_line_overrides() -> list[str]:
    return [arg for arg in sys.argv[1:] if not arg.startswith("-") and "=" in arg]


def _closest(word: str, candidates: list[str]) -> str | None:
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


def _config_keys(config_name: str, skip: str) -> list[str]:
    """Every dotted key of the config composed without the bad override (or with none, if that fails)."""

    overrides = [o for o in _command_line_overrides() if not o.lstrip("+~").startswith(f"{skip}=")]
    for attempt in (overrides, []):
        try:
            cfg = compose(config_name, attempt)
            break
        except Exception:
            continue
    else:
        return []
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else []
        for key, value in items:
            dotted = f"{prefix}{key}"
            keys.append(dotted)
            if isinstance(value, DictConfig) and not isinstance(value, ListConfig):
                walk(value, f"{dotted}.")

    walk(cfg, "")
    return keys


def _groups() -> list[str]:
    return config_groups()


def _options(group: str) -> list[str]:
    return list(group_options(group))


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_override(override)
    except Exception:
        return False
    return True


def describe_hydra_error(err: BaseException, config_name: str) -> str | None:
    """One sentence for a composition mistake, or None for anything else (reported by Hydra as usual)."""

    message = str(err).strip()
    if isinstance(err, UserError):  # raised by the template's own launcher or sweeper, in the sweep process
        return message
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, option = err.missing_cfg_file.rsplit("/", 1)
        # Hydra names no options when the bad one is in a list (callbacks=[default,progres])
        options = sorted(err.options or _options(group))
        close = _closest(option, options)
        hint = f"; did you mean {group}={close}?" if close else "."
        return f"{group}={option} is not an option of the {group} group (options: {', '.join(options)}){hint}"
    if isinstance(err, MissingConfigException):
        return f"{message.splitlines()[0]} (python src/{config_name}.py --help lists the config groups)."
    if isinstance(err, ValueError) and message.startswith("Config group override must be a string or a list"):
        groups = set(_groups())
        bad = next(
            (
                o
                for o in _command_line_overrides()
                if o.split("=", 1)[0].lstrip("+") in groups
                and o.split("=", 1)[1].strip().lower() in ("null", "none", "")
            ),
            None,
        )
        group = bad.split("=", 1)[0].lstrip("+") if bad else "<group>"
        return (
            f"{bad or 'a group override'} names no option of the {group} group; pass an option ({group}=<name>, "
            f"python src/{config_name}.py --help lists them) or leave the group out: ~{group}."
        )
    if isinstance(err, OverrideParseException):
        bad = next((repr(o) for o in sys.argv[1:] if "=" in o and not _parses(o)), None) or "an override"
        detail = message.splitlines()[0]
        return f"cannot parse {bad} ({detail}); quote values with special characters, e.g. 'key=\"a b\"'."
    found = re.search(r"Could not override '([^']+)'", message)
    if isinstance(err, ConfigCompositionException) and found:
        key = found.group(1)
        value = next(
            (o.split("=", 1)[1] for o in _command_line_overrides() if o.split("=", 1)[0] == key), "..."
        )
        value = redact.override(f"{key}={value}").split("=", 1)[1]  # a secret is not repeated
        if "No match in the defaults list" in message:
            close = _closest(key, _groups())
            hint = f"did you mean {close}={value}?" if close else f"the groups are {', '.join(_groups())}."
            return f"{key}={value} names no config group; {hint}"
        candidates = _config_keys(config_name, key) + _groups()
        close = _closest(key, candidates)
        hint = f"did you mean {close}={value}? " if close else ""
        return (
            f"{key} is not a config key; {hint}(`python src/{config_name}.py --cfg job` shows every key; "
            f"+{key}={value} adds a new one)."
        )
    if isinstance(err, ConfigCompositionException):
        return f"{message.splitlines()[0]} (python src/{config_name}.py --help lists the config groups)."
    if isinstance(err, OSError) and err.filename:
        return (
            f"cannot create {err.filename} ({err.strerror}); set paths.log_dir (or hydra.run.dir) to a "
            "directory you can write."
        )

    if isinstance(err, OmegaConfBaseException):
        key = getattr(err, "full_key", None)
        detail = message.splitlines()[0]
        return f"{key + ': ' if key else ''}{detail}; check the value you passed for it."
    return None
