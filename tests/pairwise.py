"""The pairwise matrix's cells, generated from the typed schema (`hpctrain.runtime.config.settings.all_keys`).

The rule it holds the template to: every option the schema offers, under every strategy the template
ships, either runs or is refused in one sentence (exit status 2) before the first step; never a
traceback, never a hang. The options are every boolean and every choice of the schema (an enum, or the
constants and booleans of an `anyOf`), and every `dist.*` and `trainer.*` key hpctrain reads; they are
crossed with the strategies (`STRATEGIES`), the models that tell options apart (`MODELS`: a CNN for
channels_last and the image path, the character Transformer for tensor parallelism) and the data shapes
that differ across ranks (`SHAPES`), so that every pair of values of any two of them is in some cell
(allpairspy). A key added to a settings dataclass is in the cells without a line here; the few keys
whose values a cell sets itself, or that a training run does not read, are `FIXED` with the reason.

A value the preflight refuses (`checks.check_settings` and `launch_checks.preflight`, as `src/train.py`
asks them) would stop every cell it is in before any other pair of that cell ran. So the cells are
split (`split`): a refused value leaves its cell for the key's default, and gets a cell of its own, in
the context where it was refused, which must end in that one sentence; every pair of values the preflight
admits still runs in some cell. `REFUSED_BY_MODEL` lists what only the built model refuses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import yaml
from allpairspy import AllPairs

from hpctrain.runtime.config.settings import all_keys

# The strategies the template ships, as the CPU stands them in (the same code as trainer=gpu, ddp, fsdp)
STRATEGIES = {
    "cpu": ("trainer=cpu",),
    "ddp_cpu": ("trainer=ddp_cpu",),
    "fsdp_cpu": ("trainer=fsdp_cpu",),
    "fsdp_cpu_tp2": ("trainer=fsdp_cpu", "dist.tensor_parallel=2"),
}
MODELS = ("cnn", "transformer")
# The data shapes that differ across ranks: every share even; shares one batch apart when batched plainly
# (2 ranks, batches of 4); every rank's last batch smaller than the others
SHAPES = ("even", "uneven", "small_last_batch")
# Keys the schema holds whose values are not the cells' to choose: the reason for each
FIXED = {
    "dist.timeout_min": "each cell sets a short one, so that a hang fails in seconds",
    "dist.init_timeout_min": "each cell sets a short one, so that a hang fails in seconds",
    "dist.tensor_parallel": "the strategy (fsdp_cpu_tp2)",
    "dist.tensor_parallel_plan": "the model's config ships it",
    "trainer.num_nodes": "the strategy (one machine)",
    "trainer.devices": "the strategy (2 processes, 1 for cpu)",
    "trainer.strategy": "the strategy",
}
NOT_A_RUNS = (
    "cluster.",
    "predict.",
    "eval.",
)  # a Slurm request (submit.py), src/predict.py's and src/eval.py's, not train.py's
LARGE_ENUM = 16  # a choice of more (requeue.signal: every signal) is crossed with its default and example


def values(key: str, meta: dict[str, Any], default: Any) -> list[Any]:
    """The values of one key the cells cross: both of a boolean, every choice of an enum or an anyOf's
    constants (null among them), else the default and the schema's example; a `dist.*` or `trainer.*` key
    that takes an open-ended value beside its choices, the example too."""
    schema = meta.get("schema") or {}
    found: list[Any] = []
    for part in schema.get("anyOf", [schema]):
        if part.get("type") == "boolean":
            found += [False, True]
        elif "const" in part or part.get("type") == "null":
            found.append(part.get("const"))
        elif "enum" in part:
            found += part["enum"] if len(part["enum"]) <= LARGE_ENUM else []
    open_ended = any(
        "const" not in p and "enum" not in p and p.get("type") not in ("boolean", "null")
        for p in schema.get("anyOf", [schema])
    )
    if not found or len(schema.get("enum", ())) > LARGE_ENUM:
        found = [default, _example(meta)]
    elif open_ended and key.startswith(("dist.", "trainer.")):  # dist.fsdp.shard: auto, or the example's list
        found.append(_example(meta))
    unique: dict[str, Any] = {}  # by the override that passes it: trainer.precision=16 is 16 and "16" alike
    for value in found:
        if value is not _NONE:
            unique.setdefault(_shown(value), value)
    return list(unique.values())


_NONE = object()


def _example(meta: dict[str, Any]) -> Any:
    try:
        return yaml.safe_load(str(meta.get("example")))
    except yaml.YAMLError:
        return _NONE


def factors(keys: Iterable[tuple[str, dict[str, Any]]] | None = None) -> dict[str, list[Any]]:
    """Each factor of the matrix and its values: the strategy, the model, the data shape, then every key
    of the schema that a cell crosses (`values`), in the schema's order."""
    chosen: dict[str, list[Any]] = {
        "strategy": list(STRATEGIES),
        "model": list(MODELS),
        "shape": list(SHAPES),
    }
    for key, meta in keys if keys is not None else all_keys():
        schema = meta.get("schema") or {}
        choice = schema.get("type") == "boolean" or "enum" in schema or _has_choices(schema)
        if (
            key in FIXED
            or key.startswith(NOT_A_RUNS)
            or not (choice or key.startswith(("dist.", "trainer.")))
        ):
            continue
        found = values(key, meta, _default(key))
        if len(found) > 1:
            chosen[key] = found
    return chosen


def _has_choices(schema: dict[str, Any]) -> bool:
    return any(
        p.get("type") in ("boolean", "null") or "const" in p or "enum" in p for p in schema.get("anyOf", [])
    )


def _default(key: str) -> Any:
    """The key's default, as its settings dataclass gives it."""
    from hpctrain.runtime.config.settings import SECTIONS, Settings

    first, *rest = key.split(".")
    node: Any = SECTIONS[first]() if first in SECTIONS else Settings()
    for part in rest if first in SECTIONS else [first]:
        node = getattr(node, part, _NONE)
    return node


# What the model and its config refuse, which the settings alone do not show: (model, key, value) -> the
# strategies it is refused under. The CNN has no Block (the schema's example), and both models train with
# Adam, whose eps float16 rounds to 0 (the preflight reads model.optimizer)
REFUSED_BY_MODEL = {
    ("cnn", "dist.fsdp.shard", "[Block]"): ("fsdp_cpu",),
    ("cnn", "trainer.precision", "16-true"): tuple(STRATEGIES),
    ("transformer", "trainer.precision", "16-true"): tuple(STRATEGIES),
}
CONTEXT = ("strategy", "model", "shape")
TRAINERS = {  # the trainer keys each strategy's preset sets, as the preflight reads them
    "cpu": {"accelerator": "cpu", "devices": 1, "strategy": "auto"},
    "ddp_cpu": {"accelerator": "cpu", "devices": 2, "strategy": "ddp"},
    "fsdp_cpu": {"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
    "fsdp_cpu_tp2": {"accelerator": "cpu", "devices": 2, "strategy": "fsdp"},
}


def refusal(cell: dict[str, Any]) -> str | None:
    """Why `cell` is refused before it runs (the preflight's sentence, as on a laptop: no launcher), or
    None. A cell of a strategy that needs another model (tensor parallelism: a plan) is refused too."""
    from hpctrain.runtime.config.checks import check_settings
    from hpctrain.runtime.environment import launch_checks
    from hpctrain.runtime.errors import UserError

    strategy, model = cell.get("strategy", "cpu"), cell.get("model")
    if strategy == "fsdp_cpu_tp2" and model not in (None, "transformer"):
        return "dist.tensor_parallel=2: the model's config ships no tensor-parallel plan"
    for key, value in cell.items():
        if strategy in REFUSED_BY_MODEL.get((model, key, _shown(value)), ()):
            return f"{key}={_shown(value)}: refused with this model (REFUSED_BY_MODEL)"
    tree: dict[str, Any] = {"trainer": dict(TRAINERS[strategy])}
    if strategy == "fsdp_cpu_tp2":
        tree["dist"] = {"tensor_parallel": 2, "tensor_parallel_plan": {"colwise": ["blocks.*.q"]}}
    for key, value in cell.items():
        if key not in CONTEXT:
            *path, name = key.split(".")
            node = tree
            for part in path:
                node = node.setdefault(part, {})
            node[name] = value
    try:
        settings = _settings(tree)
        check_settings(settings)
        keys, dist = settings.trainer, settings.dist
        args = (keys.num_nodes, keys.devices, keys.accelerator, settings.requeue.enabled)
        launch_checks.preflight(*args, _laptop(), dist.backend)
    except UserError as err:
        return str(err)
    return None


@functools.cache
def _laptop() -> dict[str, str]:
    from tests.helpers import local_env

    return local_env()


def _settings(tree: dict[str, Any], kind: Any = None, default: Any = None) -> Any:
    """The settings of a nested mapping of values the schema admits, built as dataclasses (OmegaConf's
    checks, which the values pass by construction, would cost a thousand times more); keys a settings
    dataclass does not have (a test's own) are left out."""
    from dataclasses import fields, replace

    from hpctrain.runtime.config.settings import Settings, _section

    kind = kind or Settings
    default = default if default is not None else kind()
    known = {f.name for f in fields(kind)}
    changes = {}
    for name, value in tree.items():
        if name not in known:
            continue
        if isinstance(value, dict) and name != "tensor_parallel_plan":
            section = _section(kind, name) or type(getattr(default, name))
            changes[name] = _settings(value, section, getattr(default, name) or section())
        else:
            changes[name] = value
    return replace(default, **changes)


def cells(
    keys: Iterable[tuple[str, dict[str, Any]]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cells that run, and the cells of the values refused. Those that run hold every pair of values
    of any two factors that some cell can run (allpairspy, with the preflight as its filter, then a cell
    more for any such pair it left out); a value refused in some context (a strategy, a model, another
    value) gets one cell there, which must end in that sentence. Deterministic: the same cells, in the
    same order, in every process that asks."""
    chosen = factors(keys)
    names = list(chosen)

    def admits(row: list[Any]) -> bool:
        return refusal(dict(zip(names, row, strict=False))) is None

    runs = [dict(zip(names, row, strict=True)) for row in AllPairs(list(chosen.values()), filter_func=admits)]
    seen = _pairs_in(runs, names)
    refused: dict[tuple[str, str], dict[str, Any]] = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for x in chosen[a]:
                for y in chosen[b]:
                    if (a, _shown(x), b, _shown(y)) in seen:
                        continue
                    tried = [{**_defaults(chosen, context), a: x, b: y} for context in _contexts()]
                    said = [(c, refusal(c)) for c in tried]
                    admitted = [c for c, sentence in said if sentence is None]
                    if admitted:  # a pair the filter left out
                        runs.append(admitted[0])
                        seen |= _pairs_in(admitted[:1], names)
                        continue
                    # a cell where the sentence is about this pair's own value, not the context's (a model
                    # without a tensor-parallel plan: the context alone)
                    about = [
                        (c, k) for c, sentence in said for k in (a, b) if str(sentence).startswith(f"{k}=")
                    ]
                    cell, key = about[0] if about else (said[0][0], None)
                    context = {k: cell[k] for k in CONTEXT}
                    refused.setdefault(
                        (key, _shown(cell.get(key))), {**context, **({key: cell[key]} if key else {})}
                    )
    return runs, list(refused.values())


def _contexts() -> list[dict[str, str]]:
    return [{"strategy": s, "model": m, "shape": SHAPES[0]} for s in STRATEGIES for m in MODELS]


def _defaults(chosen: dict[str, list[Any]], context: dict[str, str]) -> dict[str, Any]:
    """Every key at its default (a key no settings dataclass here has, a test's own: its first value)."""
    found = {k: _default(k) for k in chosen if k not in CONTEXT}
    return {**{k: chosen[k][0] if v is _NONE else v for k, v in found.items()}, **context}


def _pairs_in(found: list[dict[str, Any]], names: list[str]) -> set[tuple[str, str, str, str]]:
    return {
        (a, _shown(c[a]), b, _shown(c[b])) for c in found for i, a in enumerate(names) for b in names[i + 1 :]
    }


def generated() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`cells()` of the schema, kept in .pytest_cache under a digest of everything that decides them (the
    schema's and the preflight's code, this module, allpairspy, the GPUs the preflight would see): the
    quick tier collects the matrix without generating it again (2 to 4 s) unless one of those changed."""
    import glob
    import importlib.metadata
    import os
    from pathlib import Path

    from tests.once import kept

    runtime = Path(__file__).resolve().parents[1] / "src" / "hpctrain" / "runtime"
    sources = [
        Path(__file__),
        *sorted((runtime / "config").glob("*.py")),
        *sorted((runtime / "environment").glob("*.py")),
    ]
    seen = f"{importlib.metadata.version('allpairspy')} {os.environ.get('CUDA_VISIBLE_DEVICES')}"
    runs, refused = kept("pairwise", sources, cells, seen + " ".join(sorted(glob.glob("/dev/nvidia*"))))
    return runs, refused


def every_value_once(all_cells: list[dict[str, Any]]) -> list[int]:
    """A few of the cells in which every value of every factor appears at least once (greedy: the cell
    adding the most values not yet seen, first): what CI runs."""
    unseen = {(k, _shown(v)) for cell in all_cells for k, v in cell.items()}
    picked: list[int] = []
    while unseen:
        best = max(
            range(len(all_cells)),
            key=lambda i: len(unseen & {(k, _shown(v)) for k, v in all_cells[i].items()}),
        )
        picked.append(best)
        unseen -= {(k, _shown(v)) for k, v in all_cells[best].items()}
    return sorted(picked)


def _shown(value: Any) -> str:
    """A value as an override writes it (`null`, `true`, `[Block]`, `bf16-mixed`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def overrides(cell: dict[str, Any]) -> list[str]:
    """The cell's schema keys as command-line overrides."""
    return [f"{k}={_shown(v)}" for k, v in cell.items() if k not in ("strategy", "model", "shape")]
