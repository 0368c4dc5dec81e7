"""Hydra's composition mistakes as one sentence: an unknown key or group option (with the closest valid
one, or the `+` form that adds a new key), an override it cannot parse (`key value` for `key=value`), a
run dir it cannot create (`describe_hydra_error`, used by `command_line`)."""

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


def closest_key(key: str, candidates: list[str]) -> str | None:
    """The key that `key` most likely misspells: one of as many dotted parts, each part that differs close
    to it. A new key beside existing ones (`callbacks.swa` beside `callbacks.progress`) has none, and a
    group's key (`trainer.foo`) never matches the group (`trainer`)."""
    parts = key.split(".")
    best, best_score = None, 0.0
    for candidate in candidates:
        other = candidate.split(".")
        if len(other) != len(parts) or candidate == key:
            continue
        scores = [
            difflib.SequenceMatcher(None, a, b).ratio() for a, b in zip(parts, other, strict=True) if a != b
        ]
        score = min(scores)
        if score >= 0.6 and score > best_score:
            best, best_score = candidate, score
    return best


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


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_override(override)
    except Exception:
        return False
    return True


# Hydra's own flags that take the next word as their value (not an override)
_FLAGS_WITH_A_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn"}
_FLAGS_WITH_A_VALUE |= {"--config-dir", "-cd", "--experimental-rerun"}


def _words(argv: list[str]) -> list[str]:
    """The words of the command line that Hydra parses as overrides."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in _FLAGS_WITH_A_VALUE:
            skip = True
        elif not word.startswith("-"):
            words.append(word)
    return words


def unparsed_override(argv: list[str], detail: str = "") -> str:
    """What to say of the first word Hydra cannot parse: `key value` (or `key= value`) is one override
    written as two words; anything else, special characters to quote (`detail`: Hydra's word for it)."""
    words = _words(argv)
    at = next((i for i, word in enumerate(words) if not _parses(word)), None)
    if at is None:
        return "cannot parse an override; quote values with special characters, e.g. 'key=\"a b\"'."
    bad = words[at]
    if "=" not in bad:
        before = words[at - 1] if at > 0 else ""
        after = [w for w in words[at + 1 :] if w != "="][:1]
        if before.endswith("=") and before.count("=") == 1:
            fixed = f"{before}{bad}"
        elif after and "=" not in after[0]:
            fixed = f"{bad}={after[0]}"
        else:
            fixed = f"{bad}=<value>"
        return f"cannot parse {bad!r}: an override is key=value, one word with no spaces around '='; write {fixed}."
    return f"cannot parse {bad!r} ({detail}); quote values with special characters, e.g. 'key=\"a b\"'."


def describe_hydra_error(err: BaseException, config_name: str) -> str | None:
    """One sentence for a composition mistake, or None for anything else (reported by Hydra as usual)."""
    message = str(err).strip()
    if isinstance(err, UserError):  # raised by the template's own launcher or sweeper, in the sweep process
        return message
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, option = err.missing_cfg_file.rsplit("/", 1)
        # Hydra names no options when the bad one is in a list (callbacks=[default,progres])
        options = sorted(err.options or group_options(group))
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
        return unparsed_override(sys.argv[1:], message.splitlines()[0])
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
        close = closest_key(key, _config_keys(config_name, key) + _groups())
        shows = f"`python src/{config_name}.py --cfg job` shows every key"
        if close is None:  # a new key, not a misspelt one: the `+` form first
            return f"{key} is not a config key; to add it as a new key write +{key}={value} ({shows})."
        return f"{key} is not a config key; did you mean {close}={value}? ({shows}; +{key}={value} adds a new one)."
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
