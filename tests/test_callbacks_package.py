"""The template's callbacks: one a module in hpctrain.callbacks, named in the YAML by public paths, and
0.3's `_target_` paths, which projects' copies of the YAML still name, kept working with a warning."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings

import pytest
import yaml
from hydra._internal.utils import _locate

from hpctrain.runtime.config import targets
from tests.helpers import ROOT, parsed

# 0.3's `_target_`s in the shipped YAML, and names of its modules that moved -> where they live now (removed in 0.5, as the CHANGELOG says)
OLD_TARGETS = {
    "hpctrain.runtime.run.callbacks.ModelCheckpoint": "hpctrain.callbacks.model_checkpoint.ModelCheckpoint",
    "hpctrain.runtime.run.callbacks.EarlyStopping": "hpctrain.callbacks.early_stopping.EarlyStopping",
    "hpctrain.runtime.report.progress.progress_bar": "hpctrain.callbacks.progress_bar.progress_bar",
    "hpctrain.runtime.report.progress.ThroughputLog": "hpctrain.callbacks.throughput_log.ThroughputLog",
    "hpctrain.runtime.report.performance.PerformanceLog": "hpctrain.callbacks.performance_log.PerformanceLog",
    "hpctrain.runtime.report.trace.TraceSteps": "hpctrain.callbacks.trace_steps.TraceSteps",
    "hpctrain.runtime.run.loggers.ResumableCSVLogger": "hpctrain.loggers.ResumableCSVLogger",
    "hpctrain.runtime.run.loggers.mlflow_logger": "hpctrain.loggers.mlflow_logger",
    "hpctrain.runtime.run.loggers.wandb_logger": "hpctrain.loggers.wandb_logger",
    "hpctrain.runtime.sweeps.summary.SweepSummary": "hpctrain.runtime.sweeps.sweep_summary.SweepSummary",
    "hpctrain.runtime.run.checkpoints.start_point": "hpctrain.runtime.storage.checkpoints.start_point",
    "hpctrain.runtime.run.records.read_run_record": "hpctrain.runtime.storage.records.read_run_record",
    "hpctrain.runtime.run.attempts.summed_cost": "hpctrain.runtime.storage.attempts.summed_cost",
    "hpctrain.runtime.run.checkpoints.extras.CheckpointExtras": "hpctrain.callbacks.resume_state.ResumeState",
}
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


@pytest.mark.parametrize("old", sorted(OLD_TARGETS))
def test_an_old_target_path_still_works_and_names_the_new_one(old: str):
    with pytest.warns(FutureWarning) as warned:  # a name in a module that moved: a warning for each
        found = _locate(old)
        assert targets.locate(old) is found  # a config's and a checkpoint's targets are found so too
    assert any(f"moved to {OLD_TARGETS[old]};" in str(w.message) for w in warned), [
        str(w.message) for w in warned
    ]
    assert found is _locate(OLD_TARGETS[old])


def test_a_new_target_path_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for new in OLD_TARGETS.values():
            _locate(new)


# 0.3's checkpointing modules, which moved whole -> their home now (the same module objects)
OLD_MODULES = {
    "hpctrain.runtime.run.checkpoints.sharded": "hpctrain.runtime.storage.checkpoints.sharded",
    "hpctrain.runtime.run.checkpoints.async_writing": "hpctrain.runtime.storage.checkpoints.async_writing",
    "hpctrain.runtime.run.checkpoints.extras": "hpctrain.runtime.storage.checkpoints.resume_state",
}


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_an_old_module_path_imports_the_same_module_and_names_the_new_one(old: str, monkeypatch):
    new = importlib.import_module(OLD_MODULES[old])
    monkeypatch.delitem(sys.modules, old, raising=False)  # as a project's process imports it the first time
    with pytest.warns(FutureWarning, match=re.escape(f"moved to {OLD_MODULES[old]}")):
        assert importlib.import_module(old) is new
    with pytest.raises(ImportError):
        importlib.import_module("hpctrain.runtime.run.checkpoints.never_there")


def test_checkpoints_keep_the_resume_state_under_the_key_they_always_had():
    """Lightning files a callback's state under its `state_key`: a checkpoint written by CheckpointExtras
    (its name before 0.4) resumes its RNG and metric states, and one written now resumes under 0.3."""
    from hpctrain.callbacks.resume_state import ResumeState

    assert ResumeState().state_key == "CheckpointExtras"


def test_a_name_that_never_was_there_is_still_an_attribute_error():
    import hpctrain.runtime.run.callbacks as old_home

    with pytest.raises(AttributeError, match="Checkpointer"):
        old_home.Checkpointer  # noqa: B018


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
