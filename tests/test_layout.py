"""The structure, kept as designed: two packages with one boundary, imports that flow one way inside
the machinery, and entry points that repeat no code.

    the user's package   src/<yours>/ (here myproject): models, networks, datasets   (yours to edit)
    the machinery        src/hpctrain/, carried untouched:
                         errors, environment, namespaces < config < distributed < report, data
                         < storage (checkpoints, records, attempts) < callbacks, loggers < run
                         < sweeps, inference (what comes after training) < testing

hpctrain imports nothing of the user's package (its extension points take the user's classes from
config), and the user's package imports hpctrain only through its public API: the names of
`hpctrain.__all__` and `hpctrain.data.__all__`. Inside hpctrain a package may import its own layer and
those below it, never one above; no group of modules imports each other in a circle (lazy imports
inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hpctrain
import hpctrain.data
from tests.helpers import ROOT, parsed

SRC = ROOT / "src"
MACHINERY = "hpctrain"
USER_PACKAGES = tuple(
    sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file() and p.name != MACHINERY)
)
LAYERS = [
    {
        "hpctrain.runtime.errors",
        "hpctrain.runtime.environment",
        "hpctrain.runtime.internals",
        "hpctrain.runtime.snapshot",
        "hpctrain.runtime.remote",
        "hpctrain.runtime.run_state",
        "hpctrain.runtime.secrets",
        "hpctrain.runtime.confined",
        "hpctrain.runtime.namespaces",
        "hpctrain.conf",
    },
    {"hpctrain.runtime.config"},
    {"hpctrain.runtime.distributed"},
    {"hpctrain.runtime.report", "hpctrain.data"},
    {"hpctrain.runtime.storage"},
    {"hpctrain.callbacks", "hpctrain.loggers"},
    {"hpctrain.runtime.run"},
    {"hpctrain.runtime.sweeps", "hpctrain.runtime.inference"},
    {"hpctrain.testing"},
]
# The public API: what the user's package may import from hpctrain, module -> names.
PUBLIC = {"hpctrain": set(hpctrain.__all__), "hpctrain.data": set(hpctrain.data.__all__)}


def modules() -> dict[str, Path]:
    found = {}
    for package in (MACHINERY, *USER_PACKAGES):
        for path in (SRC / package).rglob("*.py"):
            parts = list(path.relative_to(SRC).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _ours(module: str) -> bool:
    return module.split(".")[0] in (MACHINERY, *USER_PACKAGES)


def imported_names(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> what it imports of the two packages: `module` for `import module`, `module:name` for
    `from module import name`, anywhere in its code."""
    imports: dict[str, set[str]] = {}
    for name, path in found.items():
        targets = set()
        for node in ast.walk(parsed(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
                targets.update(f"{node.module}:{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if _ours(a.name))
        imports[name] = targets
    return imports


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the two packages it imports."""
    graph: dict[str, set[str]] = {}
    for name, targets in imported_names(found).items():
        resolved = set()
        for target in targets:
            module, _, attribute = target.partition(":")
            full = f"{module}.{attribute}"
            resolved.add(full if full in found else module)
        graph[name] = {t for t in resolved if t in found and t != name}
    return graph


def boundary_crossings(imports: dict[str, set[str]]) -> list[str]:
    """Imports across the boundary that are not allowed: hpctrain -> the user's package, and the user's
    package -> anything of hpctrain but its public API."""
    wrong = []
    for source, targets in imports.items():
        for target in sorted(targets):
            module, _, name = target.partition(":")
            if source.startswith(MACHINERY) and module.split(".")[0] in USER_PACKAGES:
                wrong.append(f"{source} -> {module} (hpctrain imports the user's package)")
            elif (
                source.split(".")[0] in USER_PACKAGES
                and module.split(".")[0] == MACHINERY
                and name not in PUBLIC.get(module, set())
            ):
                wrong.append(f"{source} -> {target.replace(':', '.')} (not hpctrain's public API)")
    return wrong


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
    """The layer of the longest entry that is `module` or a package above it."""
    naming = [
        (len(entry), depth)
        for depth, layer in enumerate(LAYERS)
        for entry in layer
        if module == entry or module.startswith(entry + ".")
    ]
    return max(naming)[1] if naming else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            here, there = layer_of(source), layer_of(target)
            if here is not None and there is not None and there > here:
                wrong.append(f"{source} -> {target}")
    return sorted(wrong)


def test_there_is_a_users_package_beside_hpctrain():
    assert USER_PACKAGES and all((SRC / p / "models").is_dir() for p in USER_PACKAGES)


def test_no_import_circle():
    assert circles(import_graph(modules())) == []


def test_imports_run_down_hpctrains_layers():
    assert upward_imports(import_graph(modules())) == []


def test_the_boundary_is_crossed_only_through_the_public_api():
    assert boundary_crossings(imported_names(modules())) == []


def test_every_machinery_package_has_a_layer():
    packages = {".".join(m.split(".")[:3]) for m in modules() if m.startswith("hpctrain.runtime.")}
    packages |= {
        ".".join(m.split(".")[:2]) for m in modules() if m.count(".") >= 1 and m.startswith("hpctrain.")
    }
    packages -= {"hpctrain.runtime"}
    assert all(layer_of(p) is not None for p in packages), packages


def test_the_public_names_exist():
    for module, names in PUBLIC.items():
        imported = __import__(module, fromlist=["_"])
        assert all(getattr(imported, name, None) is not None for name in names - {"__version__"}), module


def test_the_checks_catch_an_injected_circle_an_upward_import_and_each_crossing():
    graph = import_graph(modules())
    launched = "hpctrain.runtime.environment.launched"
    graph[launched] = graph[launched] | {"hpctrain.runtime.run.build"}
    assert any(launched in group for group in circles(graph))
    assert f"{launched} -> hpctrain.runtime.run.build" in upward_imports(graph)
    storage = (
        "hpctrain.runtime.storage.checkpoints"  # storage below the callbacks, the callbacks below the run
    )
    graph[storage] = graph[storage] | {"hpctrain.callbacks.frozen_parts"}
    graph["hpctrain.callbacks.frozen_parts"] |= {"hpctrain.runtime.run.build"}
    assert {
        f"{storage} -> hpctrain.callbacks.frozen_parts",
        "hpctrain.callbacks.frozen_parts -> hpctrain.runtime.run.build",
    } <= set(upward_imports(graph))
    user = USER_PACKAGES[0]
    imports = imported_names(modules())
    imports["hpctrain.runtime.run.build"] = imports["hpctrain.runtime.run.build"] | {
        f"{user}.models.nets:MLP"
    }
    imports[f"{user}.models.nets"] = imports[f"{user}.models.nets"] | {
        "hpctrain.runtime.run.build:trainer",
        "hpctrain.data:NotPublic",
    }
    assert boundary_crossings(imports) == [
        f"hpctrain.runtime.run.build -> {user}.models.nets (hpctrain imports the user's package)",
        f"{user}.models.nets -> hpctrain.data.NotPublic (not hpctrain's public API)",
        f"{user}.models.nets -> hpctrain.runtime.run.build.trainer (not hpctrain's public API)",
    ]


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
