"""The config reaches hpctrain in one shape: the composed `DictConfig` is checked once into the typed
`Settings` (config/settings.py), and every function past that point takes the settings, or the part of
them it needs. A raw `DictConfig` is taken only at the seams listed here, each for its reason: the door
(composing, checking, recording the composition), the user's groups travelling as opaque nodes to
instantiate (model, data, callbacks, logger, the trainer's passthrough), and Hydra's own interfaces.
docs/maintainers/architecture.md ("The config's path") names the same seams.

The test scans every function of every hpctrain module, so a new function that takes a `DictConfig`
fails it until it takes the settings instead, or joins this list with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT, parsed

MACHINERY = ROOT / "src" / "hpctrain"

DOOR = "the composition itself, before or while it becomes Settings (compose, check, type it)"
RECORD = "the composition recorded whole, secrets redacted (config.yaml, trackers, checkpoints, signatures)"
BUILD = "the build: hands the user's groups (data, model, trainer, callbacks, logger) out to instantiate"
NODE = "one user's group (or entry) as an opaque node, instantiated or checked against its class"
HYDRA = "Hydra's interface hands it over (its own config, a callback's or a plugin's argument)"
TESTING = "hpctrain.testing's public API: a project's tests pass the config they composed"

SEAMS = {
    # the door
    "check_config(cfg)": DOOR,
    "_value(cfg)": DOOR,
    "_resolve_everything(cfg)": DOOR,
    "_check_loggers(cfg)": DOOR,
    "_check_notify(cfg)": DOOR,
    "_check_folds(cfg)": DOOR,
    "_check_half_adam(cfg)": DOOR,
    "_check_outputs(cfg)": DOOR,
    "Settings.of(cfg)": DOOR,
    "Job.__init__(cfg)": DOOR,
    "job(cfg)": DOOR,
    "_notify_alone(cfg)": DOOR + "; the notifier of a run that never started",
    "run_job(cfg)": DOOR,
    "run_job(task)": DOOR,
    "config_from_checkpoint(cfg)": "eval and predict: the composition with the checkpoint's model and data, "
    "checked again",
    "composed(compose)": "a file's proposal composed by the project's own configs (its model, data, monitor)",
    "_flat_keys(cfg)": "a file's proposal composed by the project's own configs (its model, data, monitor)",
    # the composition recorded
    "recorded(cfg)": RECORD,
    "environment_values(cfg)": RECORD,
    "yaml_text(cfg)": RECORD,
    "write_run_record(cfg)": RECORD,
    "config_signature(cfg)": RECORD,
    "Job._write_record(cfg)": RECORD,
    "log_hyperparameters(cfg)": RECORD,
    "apply_extras(cfg)": RECORD + "; printed as extras.print_config asks",
    "config_summary(cfg)": RECORD + "; printed",
    "print_config(cfg)": RECORD + "; printed",
    # the build and the opaque nodes
    "run_objects(cfg)": BUILD,
    "configure_process(data)": NODE + ": the data's workers, for the CPU plan",
    "cpu_plan(data)": NODE + ": the data's workers and the class it names",
    "datamodule(node)": NODE,
    "model(node)": NODE,
    "loggers(group)": NODE,
    "callbacks(cfg)": BUILD,
    "trainer(cfg)": BUILD,
    "plugins(cfg)": RECORD + ": the values the checkpoint writer puts back as interpolations",
    "stored_config(cfg)": RECORD,
    "sample_inputs(cfg)": BUILD + "; export: the job's data, for inputs",
    "_first_batch_inputs(cfg)": BUILD + "; export: the job's data, for inputs",
    "instantiated(node)": NODE,
    "check_arguments(node)": NODE,
    "_data_class_has(node)": NODE,
    "_instantiate(node)": NODE,
    "_in_namespace(node)": NODE,
    "_instantiate_named(group)": NODE,
    "check_checkpoint_entry(group)": NODE,
    "StartPoint.prepare(model_cfg)": NODE + ": the model's, against the checkpoint's",
    "StartPoint._check_checkpoint(model_cfg)": NODE + ": the model's, against the checkpoint's",
    # Hydra's interfaces
    "task_overrides(hydra_cfg)": HYDRA,
    "searchpath_overrides(hydra_cfg)": HYDRA,
    "check_hydra_env(hydra_cfg)": HYDRA,
    "write_run_record(hydra_cfg)": HYDRA,
    "SweepSummary.on_multirun_start(config)": HYDRA,
    "SweepSummary.on_multirun_end(config)": HYDRA,
    "OptunaSweeper.setup(config)": HYDRA,
    "trial_repeats(config)": HYDRA,
    # a project's tests
    "Contract.build(cfg)": TESTING,
    "Contract.trainer(cfg)": TESTING,
    "Contract.callback(cfg)": TESTING,
    "Contract.fit(cfg)": TESTING,
}


def dict_config_parameters(root: Path) -> dict[str, str]:
    """`Qualname(parameter)` -> its file, for every parameter annotated with a DictConfig under `root`."""
    found: dict[str, str] = {}

    def visit(node: ast.AST, path: Path, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, path, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = child.args
                for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
                    if arg.annotation is not None and "DictConfig" in ast.unparse(arg.annotation):
                        found[f"{prefix}{child.name}({arg.arg})"] = str(path.relative_to(root))
                visit(child, path, f"{prefix}{child.name}.")

    for path in sorted(root.rglob("*.py")):
        visit(parsed(path.read_text()), path, "")
    return found


def test_hpctrain_takes_a_raw_dict_config_only_at_its_documented_seams():
    unlisted = {k: v for k, v in dict_config_parameters(MACHINERY).items() if k not in SEAMS}
    assert unlisted == {}, (
        "these functions take a raw DictConfig: take the typed Settings (or the part needed) instead, or, "
        "for a new opaque seam, add it to SEAMS with its reason"
    )


def test_every_documented_seam_still_exists():
    assert set(SEAMS) - set(dict_config_parameters(MACHINERY)) == set()


def test_the_scan_finds_a_planted_dict_config_parameter(tmp_path: Path):
    planted = tmp_path / "src" / "hpctrain" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "from omegaconf import DictConfig\n\nclass Part:\n    def read(self, node: DictConfig | None) -> None: ...\n"
    )
    found = dict_config_parameters(planted.parent)
    assert set(found) == {"Part.read(node)"}
