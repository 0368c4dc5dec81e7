"""Imports sit at the top of hpctrain's modules, where a reader sees what a module depends on. Two kinds
may wait inside a function:

- an optional extra (the `export`, `mlflow`, `wandb`, `tensorboard` extras of pyproject.toml), imported
  where it is used so that a project without it runs everything else;
- something heavy (torch and its stack, numpy, matplotlib, ...) imported by a module on a torch-free
  path: the paths below answer `--help`, `--cfg`, every config and launch mistake, a login node's
  `scripts/submit.py` and `import hpctrain` in well under a second, before torch is imported.

TORCH_FREE_ROOTS is that documented list: the modules those paths import. Everything they import at
their top, transitively, is torch-free too, and this test checks it: none of them imports anything heavy
at its top. tests/test_train.py runs the entry points and finds no torch imported on those paths.

One path is stricter: what each entry point imports first (`hpctrain.runtime.run.entry`) prints a stored
answer to a `--help` or `--cfg` asked before (`hpctrain.runtime.config.answers`) and exits before Hydra
is imported, so there Hydra is heavy too (tests/test_config.py times it by Hydra's absence).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.helpers import ROOT, parsed

SRC = ROOT / "src"

TORCH_FREE_ROOTS = {
    "hpctrain": "`import hpctrain` is cheap: hpctrain.load imports torch on its first call",
    "hpctrain.runtime.run.entry": "each entry point's first import: signals recorded, mistakes as one sentence",
    "hpctrain.runtime.run.job": "Job's preflight (config, launcher vs trainer, run dir) runs before torch",
    "hpctrain.runtime.storage.checkpoints": "eval, predict and export find their checkpoint before the preflight",
    "hpctrain.runtime.inference.export": "src/export.py imports it before its preflight",
    "hpctrain.runtime.inference.model_card": "src/export.py imports it before its preflight",
    "hpctrain.runtime.sweeps.optuna_sweeper": "a Hydra plugin: loaded at every start of every entry point",
    "hpctrain.runtime.sweeps.slurm": "a Hydra plugin: loaded at every start of every entry point",
    "hpctrain.runtime.snapshot": "scripts/submit.py, on a login node",
    "hpctrain.runtime.remote": "scripts/submit.py, on a login node",
    "hpctrain.runtime.config.settings": "scripts/submit.py, on a login node",
    "hpctrain.runtime.sweeps.grid": "scripts/submit.py, on a login node",
    "hpctrain.runtime.storage.records": "scripts/submit.py, on a login node",
    "hpctrain.runtime.distributed.stacks": "scripts/stacks.py asks a hung job's ranks for their stacks",
    "hpctrain.testing.plugin": "pytest loads it at the start of every test session of a project",
}
HYDRA_FREE_ROOTS = {
    "hpctrain.runtime.run.entry": "a stored answer to --help or --cfg is printed before Hydra is imported",
}
HEAVY = {
    "torch", "torchvision", "torchmetrics", "pytorch_lightning", "lightning_fabric", "lightning",
    "numpy", "PIL", "matplotlib", "sklearn", "optuna", "submitit", "pynvml",
}  # fmt: skip
HEAVY_BEFORE_HYDRA = HEAVY | {"hydra"}
OPTIONAL = {
    "safetensors",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "mlflow",
    "wandb",
    "tensorboard",
    "transformers",
    "peft",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "hpctrain").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _targets(node: ast.Import | ast.ImportFrom, here: str) -> list[str]:
    """The modules an import statement imports (`from package import module` names the module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert not node.level, f"{here}: a relative import (hpctrain's imports name the whole path)"
    base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(node.test)


@functools.cache  # each module is asked about many times (every light path, every inner import)
def imports(module: str) -> tuple[frozenset[str], tuple[tuple[int, str], ...]]:
    """What `module` imports at its top (run when it is imported), and inside functions (line, module)."""
    tree = parsed(MODULES[module].read_text())
    top: set[str] = set()
    inner: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _targets(node, module):
                (inner.append((node.lineno, target)) if in_function else top.add(target))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(tree, False)
    return frozenset(top), tuple(inner)


def _package_chain(module: str) -> list[str]:
    """Importing a.b.c runs a, a.b and a.b.c."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def top_closure(start: set[str]) -> set[str]:
    """Every module importing `start` runs: hpctrain's and third-party top-level packages alike."""
    return set(_top_closure(frozenset(start)))


@functools.cache
def _top_closure(start: frozenset[str]) -> frozenset[str]:
    seen: set[str] = set()
    todo = [m for s in start for m in _package_chain(s)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if module in MODULES:
            todo.extend(m for target in imports(module)[0] for m in _package_chain(target))
    return frozenset(seen)


def heavy(module: str, heavy_names: set[str] = HEAVY) -> bool:
    return any(m.split(".")[0] in heavy_names for m in top_closure({module}))


def test_the_torch_free_roots_exist():
    assert set(TORCH_FREE_ROOTS) <= set(MODULES)


def _heavy_at_the_top(roots: set[str], heavy_names: set[str]) -> list[str]:
    return sorted(
        f"{m} imports {t} at its top"
        for m in top_closure(roots) & set(MODULES)
        for t in imports(m)[0]
        if t.split(".")[0] in heavy_names
    )


def test_nothing_on_the_torch_free_paths_imports_anything_heavy_at_its_top():
    assert _heavy_at_the_top(set(TORCH_FREE_ROOTS), HEAVY) == []


def test_nothing_before_a_stored_answer_imports_hydra_at_its_top():
    assert _heavy_at_the_top(set(HYDRA_FREE_ROOTS), HEAVY_BEFORE_HYDRA) == []


def misplaced_imports() -> list[str]:
    paths = [  # (the modules of a light path, what is heavy there)
        (top_closure(set(TORCH_FREE_ROOTS)), HEAVY),
        (top_closure(set(HYDRA_FREE_ROOTS)), HEAVY_BEFORE_HYDRA),
    ]
    wrong = []
    for module, path in sorted(MODULES.items()):
        for line, target in imports(module)[1]:
            if target.split(".")[0] in OPTIONAL:
                continue
            if any(
                module in light
                and (target.split(".")[0] in names or (target in MODULES and heavy(target, names)))
                for light, names in paths
            ):
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    return sorted(set(wrong))


def test_imports_are_at_the_top_but_the_optional_and_the_heavy_on_a_torch_free_path():
    assert misplaced_imports() == []
