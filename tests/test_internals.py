"""Every private library name in hpctrain.runtime.internals still exists: an upgrade that moves one
fails here first, naming the entry, where the template uses it and the behaviour test to run."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from hpctrain.runtime import namespaces
from hpctrain.runtime.internals import INTERNALS
from tests.helpers import EXAMPLES, ROOT


def _spellings(entry) -> list[str]:
    """The entry's module, and for Lightning's its twin in the other namespace (a run of classes written with
    `import lightning as L` relies on the same name there: hpctrain.runtime.namespaces)."""
    module_name = entry.name.partition(":")[0]
    if namespaces.owner(module_name) is None:
        return [module_name]
    return [namespace.spell(module_name) for namespace in namespaces.NAMESPACES]


CHECKED = [(entry, module) for entry in INTERNALS for module in _spellings(entry)]


@pytest.mark.parametrize(
    ("entry", "module_name"), CHECKED, ids=[m + ":" + e.name.partition(":")[2] for e, m in CHECKED]
)
def test_private_name_still_exists(entry, module_name):
    if entry.since is not None:  # newer than the oldest release of the window: absent before it
        library, _, release = entry.since.partition(" ")
        installed = importlib.import_module(library).__version__
        if _release(installed) < _release(release):
            pytest.skip(f"{entry.name} comes with {entry.since}; {library} {installed} is installed")
    path = entry.name.partition(":")[2]
    obj = importlib.import_module(module_name)
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part) and i == len(parts) - 1 and isinstance(obj, type):
            # an attribute each instance gets (self.<part> = ... in one of the class's methods)
            assigned = re.compile(rf"self\.{part}\s*(:[^=\n]*)?=")
            assert any(assigned.search(inspect.getsource(c)) for c in obj.__mro__ if c is not object), (
                f"{entry.name} is gone (used in {entry.used_in}: {entry.why}); run {entry.test}"
            )
            return
        assert hasattr(obj, part), (
            f"{entry.name} is gone (used in {entry.used_in}: {entry.why}); run {entry.test}"
        )
        obj = getattr(obj, part)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])


@pytest.mark.parametrize("entry", INTERNALS, ids=[i.name for i in INTERNALS])
def test_each_entry_names_real_files(entry):
    used_in = ROOT / "src" / "hpctrain" / entry.used_in
    assert used_in.is_file(), entry.used_in
    # the name itself, or the private attributes its `why` names (instance attributes torch cannot resolve)
    names = {entry.name.rpartition(":")[2].rpartition(".")[2], *re.findall(r"\.(_\w+)", entry.why)}
    text = used_in.read_text()
    assert any(name in text for name in names), (
        f"{entry.used_in} no longer uses {entry.name}: where is it now?"
    )
    test_file = Path(ROOT / entry.test.split("::")[0])
    if not EXAMPLES and not test_file.exists():
        pytest.skip(f"{test_file.name} tests the examples, which this project was generated without")
    assert test_file.is_file(), entry.test
