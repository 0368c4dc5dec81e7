"""What a record may keep of the config: everything but its secrets.

A run writes its config down in many places: config.yaml and .hydra/ in the run dir, run.yaml's command
and overrides, outcome.yaml, every checkpoint (the model and data config), the trackers' params
(MLflow, W&B) and the printed config in the log. Each goes through `recorded` (a config) or `text` (a
string), which keep:

- a value read from the environment (`${oc.env:NAME}`, `${oc.env:NAME,default}`) as written, not its
  value: a token passed that way never lands in a file; what depends on it shows the interpolation;
- a URL's credentials (`scheme://user:password@host`) as `user:***`, and the value of a URL's query
  parameters that hold keys (`token=`, `api_key=`, `password=`, `sig=`, ...) as `***`.

No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

HIDDEN = "***"
_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):(?P<secret>[^/@\s]+)@")
_SECRET_QUERY = re.compile(
    r"(?P<head>[?&;](?:access_token|token|api[_-]?key|apikey|key|password|passwd|pwd|secret|sig|signature|auth)=)"
    r"(?P<secret>[^&#;\s]+)",
    re.IGNORECASE,
)
_FROM_ENVIRONMENT = re.compile(r"\$\{\s*(?:oc\.env|env)\s*:")


def text(value: str) -> str:
    """`value` with the credentials of any URL in it hidden."""
    if "://" not in value and "=" not in value:
        return value
    value = _CREDENTIALS.sub(lambda m: f"{m['head']}:{HIDDEN}@", value)
    return _SECRET_QUERY.sub(lambda m: f"{m['head']}{HIDDEN}", value)


ENV_SET = "hydra.job.env_set."


def override(value: str) -> str:
    """A command line override for a record: a URL's credentials hidden, and the value of an environment
    variable set through `hydra.job.env_set.<NAME>=` hidden whole (API keys are set that way)."""
    key, sep, _ = value.partition("=")
    if sep and key.lstrip("+~").startswith(ENV_SET):
        return f"{key}={HIDDEN}"
    return text(value)


def plain(node: Any) -> Any:
    """A plain value (dicts, lists, strings, numbers) with `text` applied to every string in it."""
    if isinstance(node, Mapping):
        return {key: plain(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(plain(value) for value in node)
    if isinstance(node, str):
        return text(node)
    return node


def _environment_kept(node: Any) -> Any:
    """Strings that read the environment made literals (`${` escaped), so resolving keeps them as written."""
    if isinstance(node, Mapping):
        return {key: _environment_kept(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_environment_kept(value) for value in node]
    if isinstance(node, str) and _FROM_ENVIRONMENT.search(node):
        return node.replace("${", "\\${")
    return node


def recorded(cfg: DictConfig | ListConfig) -> Any:
    """`cfg` resolved for a record (see the module docstring), as plain containers. A value that cannot be
    resolved here is kept as written."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    kept = OmegaConf.create(_environment_kept(raw), flags={"allow_objects": True})
    try:
        resolved = OmegaConf.to_container(kept, resolve=True)
    except Exception:  # an interpolation that only resolves elsewhere (a rank, a node): keep it unresolved
        resolved = raw
    return plain(resolved)


def environment_values(cfg: DictConfig | ListConfig) -> dict[str, str]:
    """{value: interpolation} for each string the config reads from the environment: a class that keeps
    what it was given (`save_hyperparameters()`) keeps the value, and `scrub` puts the interpolation back
    in its place in a checkpoint. Values shorter than 4 characters are left alone (they say nothing)."""
    found: dict[str, str] = {}

    def visit(raw: Any, key: str) -> None:
        if isinstance(raw, Mapping):
            for name, value in raw.items():
                visit(value, f"{key}.{name}" if key else str(name))
        elif isinstance(raw, list):
            for i, value in enumerate(raw):
                visit(value, f"{key}[{i}]")
        elif isinstance(raw, str) and _FROM_ENVIRONMENT.search(raw):
            try:
                value = OmegaConf.select(cfg, key, throw_on_missing=False)
            except Exception:
                return
            if isinstance(value, str) and len(value) >= 4:
                found.setdefault(value, raw)

    visit(OmegaConf.to_container(cfg, resolve=False), "")
    return found


def scrub(node: Any, values: Mapping[str, str]) -> Any:
    """`plain(node)`, and every string equal to a value the environment gave (`environment_values`)
    replaced by its interpolation."""
    if isinstance(node, Mapping):
        return {key: scrub(value, values) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(scrub(value, values) for value in node)
    if isinstance(node, str):
        return text(values.get(node, node))
    return node


def yaml_text(cfg: DictConfig | ListConfig, resolve: bool = True) -> str:
    """The YAML of `cfg` for a file: `recorded` (resolve=True), or as written with URLs' credentials
    hidden; Hydra's own config (`{"hydra": ...}`) with the values of `job.env_set` and the overrides'
    hidden as `override` hides them."""
    content = recorded(cfg) if resolve else plain(OmegaConf.to_container(cfg, resolve=False))
    hydra = content.get("hydra") if isinstance(content, dict) else None
    if isinstance(hydra, dict):
        job = hydra.get("job") or {}
        if isinstance(job.get("env_set"), dict):
            job["env_set"] = {name: HIDDEN for name in job["env_set"]}
        for kind, values in (hydra.get("overrides") or {}).items():
            if isinstance(values, list):
                hydra["overrides"][kind] = [override(str(v)) for v in values]
    return OmegaConf.to_yaml(OmegaConf.create(content))
