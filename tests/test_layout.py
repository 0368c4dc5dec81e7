"""The package's structure, kept as designed: imports flow one way, the user's part depends on the
machinery only through its named extension points, and the entry points repeat no code.

    user's part   hpctrain.models, hpctrain.data, hpctrain.examples   (yours to edit)
    machinery     hpctrain.runtime: errors, cluster < config < distributed < report < run < sweeps

A package may import its own layer and those below it, never one above; no group of modules imports
each other in a circle (lazy imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

SRC = ROOT / "src"
LAYERS = [
    {
        "hpctrain.runtime.errors",
        "hpctrain.runtime.cluster",
        "hpctrain.runtime.moved",
        "hpctrain.runtime.internals",
        "hpctrain.runtime.snapshot",
        "hpctrain.runtime.remote",
    },
    {"hpctrain.runtime.config"},
    {"hpctrain.runtime.distributed"},
    {"hpctrain.runtime.report"},
    {"hpctrain.runtime.run"},
    {"hpctrain.runtime.sweeps"},
]
USER_PARTS = ("hpctrain.models", "hpctrain.data", "hpctrain.examples")
# What the user's part may import from the machinery: its named extension points.
EXTENSION_POINTS = {"hpctrain.runtime.errors", "hpctrain.runtime.distributed.streams"}


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "hpctrain").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports, anywhere in its code."""
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpctrain"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in found else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("hpctrain"))
        graph[name] = {t for t in targets if t in found and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int | None:
    for depth, layer in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in layer):
            return depth
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            here, there = layer_of(source), layer_of(target)
            if here is not None and there is not None and there > here:
                wrong.append(f"{source} -> {target}")
            extension_point = any(target == p or target.startswith(p + ".") for p in EXTENSION_POINTS)
            if (
                source.startswith(USER_PARTS)
                and target.startswith("hpctrain.runtime")
                and not extension_point
            ):
                wrong.append(f"{source} -> {target} (not an extension point)")
    return sorted(wrong)


def test_no_import_circle():
    assert circles(import_graph(modules())) == []


def test_imports_run_down_the_layers_and_the_users_part_uses_only_extension_points():
    assert upward_imports(import_graph(modules())) == []


def test_every_machinery_package_has_a_layer():
    packages = {".".join(m.split(".")[:3]) for m in modules() if m.startswith("hpctrain.runtime.")}
    assert all(layer_of(p) is not None for p in packages), packages


def test_the_checks_catch_an_injected_circle_and_an_upward_import():
    graph = import_graph(modules())
    graph["hpctrain.runtime.cluster"] = graph["hpctrain.runtime.cluster"] | {"hpctrain.runtime.run.build"}
    assert any("hpctrain.runtime.cluster" in group for group in circles(graph))
    assert "hpctrain.runtime.cluster -> hpctrain.runtime.run.build" in upward_imports(graph)
    graph["hpctrain.models.nets"] = {"hpctrain.runtime.run.build"}
    assert "hpctrain.models.nets -> hpctrain.runtime.run.build (not an extension point)" in upward_imports(
        graph
    )


def repeated_blocks(paths: list[Path], size: int = 6) -> list[str]:
    """Blocks of `size` or more identical lines (stripped, blank lines and comments ignored) that
    appear in more than one of `paths`."""
    seen: dict[tuple[str, ...], str] = {}
    repeats = []
    for path in paths:
        lines = [ln.strip() for ln in path.read_text().splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        for start in range(len(lines) - size + 1):
            block = tuple(lines[start : start + size])
            if block in seen and seen[block] != path.name:
                repeats.append(f"{seen[block]} and {path.name}: {block[0]} ...")
            seen.setdefault(block, path.name)
    return repeats


def test_the_entry_points_repeat_no_block_of_six_lines():
    assert repeated_blocks(sorted(SRC.glob("*.py"))) == []


def test_the_repeat_check_finds_a_copied_block(tmp_path: Path):
    block = "\n".join(f"x{i} = {i}" for i in range(6))
    (tmp_path / "a.py").write_text(block)
    (tmp_path / "b.py").write_text("y = 1\n" + block)
    assert repeated_blocks([tmp_path / "a.py", tmp_path / "b.py"])


@pytest.mark.parametrize("entry", ["train.py", "export.py"])
def test_the_entry_point_reads_as_a_short_story(entry: str):
    code = [ln for ln in (SRC / entry).read_text().splitlines() if ln.strip()]
    assert len(code) <= 50, len(code)
