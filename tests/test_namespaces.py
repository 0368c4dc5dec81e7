"""Lightning's two namespaces (`hpctrain.runtime.namespaces`): a run trains with the one its classes are
written with, `import pytorch_lightning as pl` or `import lightning as L`, and everything hpctrain builds
for it is of that one; classes of both are one sentence. The differential tests compare user code written
both ways with bare Lightning (tests/test_differential.py); here the choice itself, hpctrain's classes in
either namespace, and the example model written with `import lightning as L` through fit, test, resume,
eval and DDP."""

from __future__ import annotations

import ast
import importlib
import pickle
import re
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf

from hpctrain.callbacks.model_checkpoint import ModelCheckpoint
from hpctrain.runtime import namespaces
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LIGHTNING, PYTORCH_LIGHTNING, MixedNamespaces
from hpctrain.runtime.run import build
from tests.differential import user_code, user_code_lightning
from tests.helpers import (
    EXAMPLES,
    ROOT,
    assert_ok,
    compose_train,
    parsed,
    read_metrics,
    run_dirs,
    run_entry,
    train,
)

SRC = ROOT / "src"


def test_a_class_is_of_the_namespace_its_bases_come_from():
    assert namespaces.namespace_of(user_code.LitClassifier) is PYTORCH_LIGHTNING
    assert namespaces.namespace_of(user_code_lightning.LitClassifier) is LIGHTNING
    assert namespaces.namespace_of(user_code_lightning.Recorder()) is LIGHTNING  # an object: its class's
    assert namespaces.namespace_of(pl.callbacks.LearningRateMonitor) is PYTORCH_LIGHTNING
    assert namespaces.namespace_of(torch.nn.Linear) is None
    assert namespaces.namespace_of(ModelCheckpoint) is None  # hpctrain's own: of neither until built
    from myproject.data.digits import DigitsDataModule

    assert namespaces.namespace_of(DigitsDataModule) is None  # a project's subclass of hpctrain.data's base


def _config(**targets: str) -> OmegaConf:
    """A run's config naming `targets` (key -> class path; `callbacks.<name>` for a callback)."""
    config: dict = {"trainer": {"_target_": "pytorch_lightning.Trainer"}, "callbacks": {}, "logger": {}}
    for key, target in targets.items():
        group, _, name = key.partition("__")
        (config[group].setdefault(name, {}) if name else config.setdefault(group, {}))["_target_"] = target
    return OmegaConf.create(config)


HPCTRAIN_CALLBACKS = {
    "callbacks__model_checkpoint": "hpctrain.callbacks.model_checkpoint.ModelCheckpoint",
    "callbacks__progress": "hpctrain.callbacks.progress_bar.progress_bar",
    "callbacks__lr_monitor": "pytorch_lightning.callbacks.LearningRateMonitor",
    "logger__csv": "hpctrain.loggers.ResumableCSVLogger",
}


def test_a_run_takes_the_namespace_its_classes_are_written_with():
    lightning_user = "tests.differential.user_code_lightning"
    written_with_l = _config(
        model=f"{lightning_user}.LitClassifier",
        data="myproject.data.digits.DigitsDataModule",  # hpctrain.data's: it follows
        **HPCTRAIN_CALLBACKS,  # hpctrain's and Lightning's own (as pytorch_lightning names it): they follow
    )
    assert build.run_namespace(written_with_l) is LIGHTNING
    callback_only = _config(
        model="myproject.models.classifier.ImageClassifier",
        data="myproject.data.digits.DigitsDataModule",
        callbacks__mine=f"{lightning_user}.EpochCounter",
    )
    with pytest.raises(MixedNamespaces, match=r"model: myproject\.models\.classifier\.ImageClassifier is"):
        build.run_namespace(callback_only)  # a user's callback decides as the model does
    only_followers = _config(data="myproject.data.digits.DigitsDataModule", **HPCTRAIN_CALLBACKS)
    assert build.run_namespace(only_followers) is PYTORCH_LIGHTNING  # nothing decides: the declared package


def test_classes_of_both_namespaces_are_one_sentence_naming_one_of_each():
    mixed = _config(
        model="tests.differential.user_code_lightning.LitClassifier",
        data="tests.differential.user_code.DigitsData",
    )
    with pytest.raises(MixedNamespaces) as refused:
        build.run_namespace(mixed)
    sentence = str(refused.value)
    assert sentence.startswith(
        "model: tests.differential.user_code_lightning.LitClassifier is written with lightning.pytorch "
        "(`import lightning as L`, in "
    )
    assert (
        "but data: tests.differential.user_code.DigitsData is written with pytorch_lightning "
        f"(`import pytorch_lightning as pl`, in {ROOT / 'tests' / 'differential' / 'user_code.py'})"
    ) in sentence
    assert sentence.endswith(
        "write one of the two files with the other's imports (either package runs here)."
    )
    assert isinstance(refused.value, UserError) and sentence.count(". ") == 0  # one sentence


def _parts() -> list[type]:
    """Every LightningPart hpctrain defines (found in its source: `lightning=` in a class statement)."""
    found = []
    for path in sorted((SRC / "hpctrain").rglob("*.py")):
        for node in ast.walk(parsed(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(k.arg == "lightning" for k in node.keywords):
                module = ".".join(path.relative_to(SRC).with_suffix("").parts)
                found.append(getattr(importlib.import_module(module), node.name))
    return found


PARTS = _parts()


def test_hpctrain_has_parts_of_every_kind():
    names = {cls.__name__ for cls in PARTS}
    assert {"ModelCheckpoint", "HydraDDPStrategy", "HydraJobLauncher", "AtomicCheckpointIO"} <= names
    assert {"ImageDataModule", "ResumableCSVLogger", "OneGPUPerTaskSLURMEnvironment", "LogProgress"} <= names
    assert {"TokenizedDataModule", "BatchLimits", "TrainableOnly", "PredictionWriter"} <= names


@pytest.mark.parametrize("part", PARTS, ids=[c.__qualname__ for c in PARTS])
def test_each_of_hpctrains_classes_is_a_class_of_either_namespace(part: type):
    made = {namespace: namespace.part(part) for namespace in namespaces.NAMESPACES}
    for namespace, cls in made.items():
        assert issubclass(cls, part) and issubclass(cls, namespace.get(part.lightning_base))
        assert namespaces.namespace_of(cls) is namespace
        # a callback's state in a checkpoint is keyed by its qualified name: the same in both namespaces
        assert (cls.__module__, cls.__qualname__) == (part.__module__, part.__qualname__)
        assert namespace.part(part) is cls  # made once
    assert made[LIGHTNING] is not made[PYTORCH_LIGHTNING]


def test_a_part_is_made_of_the_namespace_being_built_and_pickles_as_such():
    outside = ModelCheckpoint(dirpath="/tmp/x", monitor="val_loss")  # a notebook's: the declared package
    assert isinstance(outside, pl.callbacks.ModelCheckpoint) and not isinstance(outside, L.Callback)
    with namespaces.building(LIGHTNING):
        inside = ModelCheckpoint(dirpath="/tmp/x", monitor="val_loss")
        data = user_code_lightning.DigitsData()  # a user's own class is what it is written with
    assert isinstance(inside, L.callbacks.ModelCheckpoint) and not isinstance(inside, pl.Callback)
    assert isinstance(inside, ModelCheckpoint) and isinstance(outside, ModelCheckpoint)
    assert inside.state_key == outside.state_key  # checkpoints of either namespace's runs read each other's
    assert namespaces.namespace_of(data) is LIGHTNING
    again = pickle.loads(pickle.dumps(inside))  # a class made at run time pickles by its neutral class
    assert type(again) is type(inside) and again.monitor == "val_loss"


@pytest.mark.skipif(not EXAMPLES, reason="the project was generated without the examples")
def test_the_shipped_experiments_train_under_the_package_their_code_imports(tmp_path: Path):
    """The language-model fine-tuning example (its model and sample callback) is written with `import
    lightning as L`: its runs are of the lightning package, with the template's data and callbacks
    following; the other examples' runs, the character model's with its own sample callback, are of
    pytorch_lightning (tests/test_llm.py trains the first, tests/test_beyond_mnist.py the second)."""
    chosen = {
        experiment: build.run_namespace(compose_train(tmp_path, tmp_path, f"experiment={experiment}"))
        for experiment in ("lora_sft", "char_transformer")
    }
    assert chosen == {"lora_sft": LIGHTNING, "char_transformer": PYTORCH_LIGHTNING}


def test_a_model_or_datamodule_built_alone_is_of_the_namespace_its_config_chooses():
    """hpctrain.load, export and the contract tests build a checkpoint's model and data without a run."""
    cfg = _config(
        model="tests.differential.user_code_lightning.LitClassifier",
        data="myproject.data.digits.DigitsDataModule",
    )
    assert isinstance(build.model(cfg.model), L.LightningModule)  # the class its own namespace
    with build.namespace_of_run(cfg):  # the template's data follows the model of the config
        assert isinstance(build.datamodule(cfg.data, Settings.of(cfg)), L.LightningDataModule)
    alone = _config(data="myproject.data.digits.DigitsDataModule")
    assert isinstance(build.datamodule(alone.data, Settings.of(alone)), pl.LightningDataModule)


def test_lightnings_own_classes_in_the_config_are_built_from_the_runs_namespace():
    node = OmegaConf.create(
        {
            "_target_": "pytorch_lightning.Trainer",
            "plugins": [{"_target_": "lightning_fabric.plugins.environments.LightningEnvironment"}],
            "net": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1},
        }
    )
    assert build._in_namespace(node, PYTORCH_LIGHTNING) is node  # nothing to change
    respelled = build._in_namespace(node, LIGHTNING)
    assert respelled["_target_"] == "lightning.pytorch.Trainer"
    assert respelled["plugins"][0]["_target_"] == "lightning.fabric.plugins.environments.LightningEnvironment"
    assert respelled["net"]["_target_"] == "torch.nn.Linear"
    assert PYTORCH_LIGHTNING.spell("lightning.pytorch.callbacks.EarlyStopping") == (
        "pytorch_lightning.callbacks.EarlyStopping"
    )


def test_the_lightning_packages_own_console_handler_does_not_print_each_line_twice():
    """`import lightning` gives the `lightning` logger a console handler of its own (`INFO: ...`); under the
    run's handlers (Hydra's console and <task>.log) its records are printed once, by those."""
    import logging

    from hpctrain.runtime.report import console

    ours, theirs = logging.getLogger(), logging.getLogger("lightning")
    kept = list(theirs.handlers)
    own = logging.StreamHandler()
    theirs.addHandler(own)
    root = logging.NullHandler()
    ours.addHandler(root)
    try:
        console.lightning_logs_once()
        assert own not in theirs.handlers and theirs.propagate
    finally:
        ours.removeHandler(root)
        theirs.handlers[:] = kept


# What hpctrain may import from Lightning by name: functions and constants that are the same whichever
# namespace a run trains with (no isinstance against one package's classes, no state of their own).
NAMESPACE_FREE = {
    "pytorch_lightning.loggers.logger": {"rank_zero_experiment"},  # reads lightning_utilities' rank
    "pytorch_lightning.utilities.data": {"extract_batch_size"},
    "pytorch_lightning": {"LightningModule", "LightningDataModule"},  # their checkpoint key names only
    "lightning_fabric.utilities.throughput": {"get_available_flops", "measure_flops"},
    "lightning_fabric.utilities.apply_func": {"move_data_to_device"},
    "lightning_fabric.utilities.types": {"_Stateful"},  # a structural protocol
    "lightning_fabric.utilities.seed": {"seed_everything"},  # seeds and environment variables
}


def test_hpctrain_imports_from_lightning_only_what_is_the_same_in_both_namespaces():
    """A class imported from one namespace and used as a base or in an isinstance check would be wrong in a
    run of the other: hpctrain's Lightning classes are LightningParts, Lightning's classes are asked of the
    run's namespace (`Namespace.get`). Type hints (under TYPE_CHECKING) name pytorch_lightning's."""
    wrong = []
    for path in sorted((SRC / "hpctrain").rglob("*.py")):
        tree = parsed(path.read_text())
        hints = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in hints:
                continue
            if isinstance(node, ast.Import):
                wrong += [f"{path.name}: import {a.name}" for a in node.names if namespaces.owner(a.name)]
                wrong += [f"{path.name}: import {a.name}" for a in node.names if a.name == "lightning"]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and (namespaces.owner(node.module) or node.module == "lightning")
            ):
                allowed = NAMESPACE_FREE.get(node.module, set())
                wrong += [
                    f"{path.name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name not in allowed
                ]
    assert wrong == []


def test_a_class_written_with_lightning_where_it_is_not_installed_is_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "lit_missing.py").write_text(
        "import lightning as L\n\nclass LitNet(L.LightningModule):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        sys.modules, "lightning", None
    )  # `import lightning` fails as where it is not installed
    with pytest.raises(UserError) as refused:
        build.model(OmegaConf.create({"_target_": "lit_missing.LitNet"}))
    assert str(refused.value).startswith(
        "_target_: lit_missing.LitNet cannot be imported: it is written with the `lightning` package"
    )
    assert "pip install 'lightning>=2.6,<2.7'" in str(refused.value)


# ---------------------------------------------------------------------------------------------- slow


def _classifier_written_with_import_lightning(package: Path) -> str:
    """src/myproject/models/classifier.py (quickstart's model) as written with `import lightning as L`, in
    a package of the user's outside the project; its `_target_`."""
    source = (SRC / "myproject" / "models" / "classifier.py").read_text()
    written = source.replace("from pytorch_lightning import LightningModule\n", "import lightning as L\n")
    written = written.replace(
        "class ImageClassifier(LightningModule):", "class ImageClassifier(L.LightningModule):"
    )
    assert written.count("L.LightningModule") == 1 and "pytorch_lightning" not in written, (
        "classifier.py changed"
    )
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "classifier.py").write_text(written)
    return f"{package.name}.classifier.ImageClassifier"


@pytest.mark.slow
def test_the_example_model_written_with_import_lightning_trains_resumes_and_evaluates(tmp_path: Path):
    """quickstart's model written with `import lightning as L` (the template's digits data follows it):
    fit and test with DDP on CPU, a resumed run, and eval.py on its checkpoint, each under the lightning
    package's Trainer; the resumed run's epoch is the one after."""
    target = _classifier_written_with_import_lightning(tmp_path / "lit_models")
    env = {"PYTHONPATH": str(tmp_path)}
    logs = tmp_path / "logs"
    short = (
        "experiment=quickstart",
        f"model._target_={target}",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "callbacks.progress.mode=log",
    )
    # (pytorch_lightning's Trainer would refuse the module: a run that completes ran under lightning's)
    assert_ok(train(logs, *short, "trainer=ddp_cpu", "trainer.max_epochs=1", env=env))
    (run,) = run_dirs(logs)
    logged = {key for row in read_metrics(run) for key, value in row.items() if value}
    assert {"train/acc", "val/acc", "test/acc"} <= logged
    last = run / "checkpoints" / "last.ckpt"

    resumed = train(logs, *short, "trainer=cpu", "trainer.max_epochs=2", f"ckpt_path={last}", env=env)
    assert_ok(resumed)
    assert f"starting from {last}" in resumed.stdout
    second = next(r for r in run_dirs(logs) if r != run)
    assert {row["epoch"] for row in read_metrics(second) if row.get("val/acc")} == {"1"}

    evaluated = run_entry(
        "eval.py",
        f"paths.log_dir={logs}",
        "extras.print_config=false",
        f"ckpt_path={second / 'checkpoints' / 'last.ckpt'}",
        f"model._target_={target}",  # its class, named as at training (a checkpoint names no code)
        env=env,
    )
    assert_ok(evaluated)
    assert re.search(r"test/acc\s+\d", evaluated.stdout)  # tested, under the lightning package's Trainer
