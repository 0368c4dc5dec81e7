"""What a record may keep of the config: everything but its secrets.

A run writes its config down in many places: config.yaml and .hydra/ in the run dir, run.yaml's command
and overrides, outcome.yaml, every checkpoint (the model and data config), the trackers' params
(MLflow, W&B) and the printed config in the log. Each goes through `recorded` (a config) or `text` (a
string), which keep secrets out by construction, not by the names they go under:

- a value that came from a resolver (`${oc.env:NAME}`, `${hydra:...}`, `${oc.decode:...}`, a project's
  own resolver) is recorded as written, not as its value: whatever a resolver reads (the environment, a
  vault, Hydra's `job.env_set`) never lands in a file; what depends on it shows the interpolation. Only
  hpctrain's own path and name resolvers, which read nothing secret (`HARMLESS_RESOLVERS`), and Hydra's
  run dir, job name and choices (`HARMLESS_HYDRA_KEYS`) resolve;
- every URL is parsed (`hpctrain.runtime.secrets`): its userinfo, its query values (but a few harmless
  keys), its fragment and a webhook's path are hidden as `***`;
- the values of `hydra.job.env_set` (API keys are set that way) are hidden whole.

No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from hpctrain.runtime.secrets import HIDDEN, hide

# hpctrain's own resolvers whose values are paths and names it makes itself (hpctrain.runtime.config.resolvers)
HARMLESS_RESOLVERS = frozenset({"project_root", "project_name", "run_id"})
# Hydra's own keys for where and as what a job runs (its run dir, job name and number, the choices): paths
# and names it makes itself. Its other keys (`job.env_set` holds API keys) stay as written.
HARMLESS_HYDRA_KEYS = (
    "runtime.output_dir",
    "runtime.choices.",
    "run.dir",
    "sweep.",
    "job.name",
    "job.num",
    "mode",
)
_RESOLVER = re.compile(r"\$\{\s*([\w.\-]+)\s*:\s*([^}$]*)")


def text(value: str) -> str:
    """`value` with the secret parts of every URL in it hidden (`hpctrain.runtime.secrets`)."""
    return hide(value)


def _from_a_resolver(value: str) -> bool:
    """Whether a config string calls a resolver other than hpctrain's harmless ones (and Hydra's for its
    harmless keys)."""
    return any(not _harmless(name, argument.strip()) for name, argument in _RESOLVER.findall(value))


def _harmless(resolver: str, argument: str) -> bool:
    if resolver == "hydra":  # a key, or a section ("sweep.") whole or any key under it
        return any(
            argument == key.rstrip(".") or (key.endswith(".") and argument.startswith(key))
            for key in HARMLESS_HYDRA_KEYS
        )
    return resolver in HARMLESS_RESOLVERS


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


def _escaped(value: str) -> str:
    """`value` as an OmegaConf string that resolves to exactly `value` (k backslashes before `${` become
    2k+1: each pair reads as one backslash, the last escapes the interpolation)."""
    return re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m[1]) + 1) + "${", value)


def _resolvers_kept(node: Any) -> Any:
    """Strings that call a resolver made literals, so that resolving keeps them as written."""
    if isinstance(node, Mapping):
        return {key: _resolvers_kept(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolvers_kept(value) for value in node]
    if isinstance(node, str) and _from_a_resolver(node):
        return _escaped(node)
    return node


def recorded(cfg: DictConfig | ListConfig, groups: tuple[str, ...] = ()) -> Any:
    """`cfg` resolved for a record (see the module docstring), as plain containers; with `groups`, those
    of its sections only, each resolved where it stands. What cannot be resolved here is kept as written."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    kept = OmegaConf.create(_resolvers_kept(raw), flags={"allow_objects": True})
    if groups:
        return {g: plain(_resolved(kept[g], raw[g])) for g in groups if isinstance(raw, dict) and g in raw}
    return plain(_resolved(kept, raw))


def _resolved(node: Any, raw: Any) -> Any:
    if not OmegaConf.is_config(node):
        return node
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation that only resolves elsewhere (a rank, a node): keep it unresolved
        return raw


def environment_values(cfg: DictConfig | ListConfig) -> dict[str, str]:
    """{value: interpolation} for each string the config gets from a resolver (the environment, most
    often): a class that keeps what it was given (`save_hyperparameters()`) keeps the value, and `scrub`
    puts the interpolation back in its place in a checkpoint. Values shorter than 4 characters are left
    alone (they say nothing)."""
    found: dict[str, str] = {}

    def visit(raw: Any, key: str) -> None:
        if isinstance(raw, Mapping):
            for name, value in raw.items():
                visit(value, f"{key}.{name}" if key else str(name))
        elif isinstance(raw, list):
            for i, value in enumerate(raw):
                visit(value, f"{key}[{i}]")
        elif isinstance(raw, str) and _from_a_resolver(raw):
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
