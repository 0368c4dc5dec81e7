"""Generated attacks on what a received file may name: not a list of known tricks, but every name an
attacker could write as a stored `_target_` to reach code through the modules this project and hpctrain
import.

For each module of the user's package and of hpctrain, the candidates are (`candidates`):
- every name it holds that is another module (`<module>.<imported module>`),
- every callable one hop inside that module (`<module>.<imported module>.<callable>`: Hydra resolves a
  dotted name attribute by attribute, so `<package>.<mod>.torch.hub.load` reaches torch.hub.load),
- every callable it holds that it did not define (`<module>.<imported callable>`).
A file proposes options and values, never code (`hpctrain.runtime.config.proposals`): each candidate,
stored as a `_target_` at three depths, is refused by the one function every reader calls, before
anything is looked up or imported (checked in-process for a sample of thousands, and for all of them at
once in one proposal), and through `hpctrain.load` for a sample; a run folder's files holding all of them
at once give nothing to resolve to any reader; and a real entry point refuses the walk that ran a shell
command from a `.ckpt` before (`...torch.multiprocessing...spawnv_passfds`).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

import hpctrain
from hpctrain.runtime.config import proposals, targets
from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import reading
from tests.helpers import run_entry

PACKAGES = ("hpctrain", *targets.project_packages())


@dataclass
class Candidates:
    modules: int = 0
    not_importable: list[str] = field(default_factory=list)  # an optional extra not installed
    walks: set[str] = field(default_factory=set)  # through a module another one imports
    imported: set[str] = field(default_factory=set)  # a callable its module did not define
    names: set[str] = field(default_factory=set)  # every candidate (also real submodule paths)


def _modules() -> tuple[dict[str, types.ModuleType], list[str]]:
    found, failed = {}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an optional extra's import may warn
        for package in PACKAGES:
            root = importlib.import_module(package)
            names = [package, *(m.name for m in pkgutil.walk_packages(root.__path__, f"{package}."))]
            for name in names:
                try:
                    found[name] = importlib.import_module(name)
                except Exception:  # an optional extra (mlflow, optuna, ...) that is not installed
                    failed.append(name)
    return found, failed


def _held(obj: types.ModuleType) -> list[tuple[str, object]]:
    return [(k, v) for k, v in list(vars(obj).items()) if not k.startswith("__")]


@pytest.fixture(scope="module")
def candidates() -> Candidates:
    modules, failed = _modules()
    found = Candidates(modules=len(modules), not_importable=failed)
    for name, module in modules.items():
        for attribute, value in _held(module):
            path = f"{name}.{attribute}"
            if isinstance(value, types.ModuleType):
                found.names.add(path)
                # its own submodule (the import system holds that exact name for it): a real path
                own = value.__name__ == path or sys.modules.get(path) is value
                if not own:
                    found.walks.add(path)
                for inner, held in _held(value):
                    if callable(held) and not isinstance(held, types.ModuleType):
                        found.names.add(f"{path}.{inner}")
                        if not own:
                            found.walks.add(f"{path}.{inner}")
            elif callable(value) and getattr(value, "__module__", None) != name:
                found.names.add(path)
                found.imported.add(path)
    return found


@pytest.mark.slow  # imports every module of both packages (and their optional extras that are installed)
def test_every_generated_name_as_a_stored_target_is_refused_before_anything_is_looked_up(
    candidates: Candidates, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    names = sorted(candidates.names)
    assert len(names) > 10_000 and candidates.modules > 100, (len(names), candidates.modules)
    looked_up: list[str] = []
    real_locate = targets.locate
    monkeypatch.setattr(targets, "locate", lambda name: looked_up.append(name) or real_locate(name))
    composed = compose("train", ["experiment=quickstart"])
    options = {"model": "mnist_cnn", "model/net": "mnist_cnn", "data": "digits"}

    def propose(values: dict) -> None:
        stored = {"choices": options, **values}
        proposals.composed(proposals.proposal_of(stored, "ckpt_path=f"), [], lambda _: composed.copy())

    for name in names[
        :: max(1, len(names) // 300)
    ]:  # at the top, nested in the project's own model, in the data
        for values in (
            {"model": {"_target_": name}},
            {"model": {"net": {"layers": [{"_target_": name}]}}},
            {"data": {"_target_": name}},
        ):
            with pytest.raises(proposals.ProposalRefused, match="which this project's configs do not give"):
                propose(values)
    with pytest.raises(proposals.ProposalRefused):  # all of them at once: still nothing looked up
        propose({"model": {f"k{i}": {"_target_": name} for i, name in enumerate(names)}})
    # the same rule, reached as every entry point reaches it: the checkpoint reader and hpctrain.load
    for i, name in enumerate(names[:: max(1, len(names) // 30)]):
        path = tmp_path / f"{i}.ckpt"
        torch.save(
            {"state_dict": {}, reading.CONFIG_KEY: {"choices": options, "model": {"_target_": name}}}, path
        )
        with pytest.raises(
            UserError, match=r"was trained with model._target_=\S+, which this project's configs"
        ):
            hpctrain.load(path)
    assert looked_up == []


@pytest.mark.slow  # the same modules imported (the fixture is shared)
def test_a_run_folders_files_give_nothing_to_resolve(
    candidates: Candidates, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """run.yaml (its overrides and command), config.yaml, .hydra/ and outcome.yaml each naming a thousand
    candidates of every module: whatever reads a run folder (the model card's records, a sweep's summary, a
    plot) reads values, and resolves none of them. (A thousand, not all: YAML of 68,000 overrides takes
    minutes to write and read, and what a reader does with a value does not depend on which it is.)"""
    from hpctrain.runtime.inference import model_card
    from hpctrain.runtime.report import plots
    from hpctrain.runtime.storage import records
    from hpctrain.runtime.sweeps import summary

    everything = sorted(candidates.names)
    names = everything[:: max(1, len(everything) // 1000)]
    resolved: list[str] = []
    real_locate = targets.locate
    monkeypatch.setattr(targets, "locate", lambda name: resolved.append(name) or real_locate(name))
    run = tmp_path / "sweep" / "0"
    (run / ".hydra").mkdir(parents=True)
    overrides = [f"model.net._target_={name}" for name in names]
    config = {"model": {"_target_": names[0], "layers": [{"_target_": n} for n in names]}}
    (run / "run.yaml").write_text(
        yaml.safe_dump({"command": " ".join(overrides), "overrides": overrides, "attempts": []})
    )
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "diagnostics": {"stacks_signal": "SIGURG"}}))
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / "outcome.yaml").write_text(yaml.safe_dump({"status": "completed", "overrides": overrides}))
    (run / "metrics.csv").write_text("step,train/loss\n0,1.0\n")
    records.read_run_record(run), records.read_outcome(run)
    model_card._metrics(run), model_card._code(run)
    summary.rows(tmp_path / "sweep")
    plots.read_series(run / "metrics.csv")
    assert resolved == []


@pytest.mark.slow  # one real entry point: a process
def test_the_walk_that_ran_a_shell_command_from_a_checkpoint_is_refused_by_eval(tmp_path: Path):
    """The reproduction: a .ckpt that loads with weights_only=True and whose stored model names a
    callable through `<package>.<module>.torch...` (Hydra's lookup reaches multiprocessing's spawnv_passfds
    and runs /bin/sh). eval refuses it in one sentence, before anything is imported; nothing runs."""
    marker = tmp_path / "code-ran"
    holder = next(
        name
        for name, module in sorted(_modules()[0].items())
        if name.startswith(targets.project_packages())
        and isinstance(vars(module).get("torch"), types.ModuleType)
    )
    walk = f"{holder}.torch.multiprocessing.multiprocessing.util.spawnv_passfds"
    model = {
        "_target_": walk,
        "path": {"_target_": f"{holder}.torch.os.fsencode", "_args_": ["/bin/sh"]},
        "args": ["/bin/sh", "-c", f"touch {marker}"],
        "passfds": [],
    }
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, reading.CONFIG_KEY: {"model": model}}, path)
    result = run_entry("eval.py", f"paths.log_dir={tmp_path}", f"ckpt_path={path}", timeout=120)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stdout[-3000:]
    assert f"was trained with model._target_={walk}" in errors[0] and "do not give" in errors[0]
    assert "Traceback" not in result.stdout and not marker.exists()
