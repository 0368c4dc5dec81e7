"""The template's callbacks: one a module in hpctrain.callbacks, named in the YAML by public paths."""

from __future__ import annotations

import ast
import re

import yaml

from tests.helpers import ROOT, parsed

PACKAGE = ROOT / "src" / "hpctrain" / "callbacks"
# Hydra's callback that ends a sweep sits in the sweeps' layer, above the run (Lightning's sit below it)
SWEEP_CALLBACK = "hpctrain.runtime.sweeps.sweep_summary.SweepSummary"
SHIPPED_YAML = [*(ROOT / "conf").rglob("*.yaml"), *(ROOT / "src" / "hpctrain" / "conf").rglob("*.yaml")]


def _targets(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return found + [t for value in node.values() for t in _targets(value)]
    if isinstance(node, list):
        return [t for value in node for t in _targets(value)]
    return []


def test_checkpoints_keep_the_resume_state_under_the_key_they_always_had():
    """Lightning files a callback's state under its `state_key`: a checkpoint written by CheckpointExtras
    (its name before 0.4) resumes its RNG and metric states, and one written now resumes under 0.3."""
    from hpctrain.callbacks.resume_state import ResumeState

    assert ResumeState().state_key == "CheckpointExtras"


def test_the_shipped_yaml_names_no_internal_module():
    internal = [
        f"{path.relative_to(ROOT)}: {target}"
        for path in SHIPPED_YAML
        for target in _targets(yaml.safe_load(path.read_text()))
        if target.startswith("hpctrain.runtime.") and target != SWEEP_CALLBACK
    ]
    assert internal == []


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def test_each_callback_lives_in_the_module_named_after_it():
    misplaced = []
    for path in PACKAGE.glob("*.py"):
        for node in parsed(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(b) for b in node.bases}
                callback = any(b.endswith(("Callback", "Checkpoint", "EarlyStopping")) for b in bases)
                if callback and _snake(node.name) != path.stem:
                    misplaced.append(f"{node.name} in {path.name}")
    assert misplaced == []
