"""Your own code behaves as under bare Lightning: each case of tests/differential/cases.py is trained by a
plain `pl.Trainer` script and by `python src/train.py`, and what a user observes is compared: which
hooks ran and how often (per rank), every row of metrics.csv, the test metrics, and the epoch and step
that last.ckpt holds. Values are compared with a relative tolerance of 1e-6 (they are equal on CPU).

Where the template deliberately differs, the test says so: its run dir and progress output, and
last.ckpt, which here always holds the newest state (bare Lightning 2.6 may leave the best epoch's there).

The user code is written with `import pytorch_lightning as pl`, and for the cases of WRITTEN_WITH_LIGHTNING
also with `import lightning as L` (tests/differential/user_code_lightning.py), compared with a bare Trainer
of the `lightning` package: every object the Trainer runs with is of the user code's package, on both sides.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from tests.differential.cases import CASES, reader_overrides, template_overrides
from tests.helpers import ROOT, TIMING_PREFIXES, assert_ok, run_dirs, run_entry, run_script, train

pytestmark = pytest.mark.slow

OWN_TEST = (
    "checkpoint_state_resume",
    "onecycle_mid_epoch_resume",
    "net_in_hparams",
    "logs_nothing",
    "two_val_sets",
    "best_before_resume",
)
SINGLE_RUN = [
    name for name in CASES if name not in OWN_TEST and not name.startswith("corpus_")
]  # tests/test_corpus.py
# written with `import lightning as L` too: a module, a datamodule, a callback of the user's and one of
# Lightning's (DDP under the lightning package: tests/test_namespaces.py runs quickstart's model so)
WRITTEN_WITH_LIGHTNING = ["lambda_callback"]


def _env(out: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "DIFF_OUT": str(out)}


def run_bare(case: str, out: Path, *args: str, package: str = "pytorch_lightning") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    command = ("tests/differential/bare.py", case, str(out), *args, "--package", package)
    assert_ok(run_script(*command, env=_env(out)))
    return out


def run_template(case: str, out: Path, *overrides: str, **kwargs) -> Path:
    """Train the case with src/train.py; returns its run dir (the recorder's files go to `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    result = train(out / "logs", *template_overrides(CASES[case], **kwargs), *overrides, env=_env(out))
    assert_ok(result)
    (run,) = run_dirs(out / "logs")
    return run


def hooks(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("hooks-rank*.json"))}


def rows(metrics_csv: Path) -> list[dict[str, str]]:
    """The logged rows, less the template's performance figures (callbacks.performance stays on: what it
    does, counting FLOPs on a meta copy of the model included, must change nothing the user logs)."""
    if not metrics_csv.exists():  # Lightning's CSVLogger writes no file for a model that logs nothing
        return []
    with open(metrics_csv, newline="") as file:
        found = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(file)]
    kept = [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)} for row in found]
    return [row for row, was in zip(kept, found, strict=True) if set(row) - {"step", "epoch"} or row == was]


def assert_same_rows(template: list[dict[str, str]], bare: list[dict[str, str]]) -> None:
    assert [sorted(r) for r in template] == [sorted(r) for r in bare], "different metrics or rows logged"
    for mine, theirs in zip(template, bare, strict=True):
        for key, value in theirs.items():
            assert math.isclose(float(mine[key]), float(value), rel_tol=1e-6, abs_tol=1e-9), (
                key,
                mine,
                theirs,
            )


def last_checkpoint(run_or_out: Path) -> tuple[int, int, dict]:
    checkpoint = torch.load(run_or_out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return checkpoint["epoch"], checkpoint["global_step"], checkpoint


def trained_as_under_bare_lightning(
    name: str, tmp_path: Path, package: str = "pytorch_lightning"
) -> tuple[Path, Path]:
    """Train the case both ways and compare; returns the bare run's output and the template's run dir.
    `package`: the one the user code imports Lightning from."""
    bare = run_bare(name, tmp_path / "bare", package=package)
    mine = tmp_path / "template"
    run = run_template(name, mine, package=package)

    assert hooks(mine) == hooks(bare)  # every hook, every rank, as often (and where training ended)
    assert len(hooks(bare)) == CASES[name].processes
    for rank in hooks(mine).values():  # the Trainer and all it runs with: of the user code's package
        assert rank["notes"]["packages"] == [package]
    assert_same_rows(rows(run / "metrics.csv"), rows(bare / "metrics.csv"))
    # Deliberate difference: last.ckpt holds where training ended (the bare run's last epoch end),
    # whether or not the monitored metric improved there.
    ended = hooks(bare)["hooks-rank0.json"]["notes"]["last_epoch_end"]
    assert list(last_checkpoint(run)[:2]) == ended
    case = CASES[name]
    monitored = case.monitor is not None and case.monitor[0] is not None
    assert outcome(run)["status"] == "completed"
    assert (outcome(run)["value"] is not None) == monitored  # the best value, for sweeps
    if not monitored and not case.checkpoint_every_epoch:  # no metric to pick a best by: last.ckpt only
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    return bare, run


@pytest.mark.parametrize("name", SINGLE_RUN)
def test_user_code_behaves_as_under_bare_lightning(name: str, tmp_path: Path):
    trained_as_under_bare_lightning(name, tmp_path)


@pytest.mark.parametrize("name", WRITTEN_WITH_LIGHTNING)
def test_user_code_written_with_import_lightning_behaves_as_under_its_bare_trainer(name: str, tmp_path: Path):
    """The same user code written with `import lightning as L` runs under the `lightning` package's
    Trainer, with hpctrain's callbacks, strategy, launcher, cluster environment, checkpoint IO and logger
    of that package, and observes what it observes under a bare `L.Trainer`."""
    trained_as_under_bare_lightning(name, tmp_path, package="lightning")


def outcome(run: Path) -> dict:
    return yaml.safe_load((run / "outcome.yaml").read_text())


def test_a_network_kept_in_save_hyperparameters_trains_tests_resumes_and_is_used(tmp_path: Path):
    """lightning-hydra-template's way of writing a module: the network and partial optimizers are
    arguments kept by save_hyperparameters(). Bare Lightning trains it but cannot test its best checkpoint
    with weights_only loading; here the checkpoints keep the plain hyperparameters only (said once), so
    the test after fit, ckpt_path=last, eval, predict, export, init_from and hpctrain.load all read them
    with weights_only=True."""
    bare, run = trained_as_under_bare_lightning("net_in_hparams", tmp_path)
    log = (run / "train.log").read_text()
    assert log.count("checkpoints keep the plain values of save_hyperparameters() only") == 1
    assert (
        "left out: net (SimpleDenseNet), optimizer (partial Adam), scheduler (partial ReduceLROnPlateau)"
        in log
    )
    last = run / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"] == {"compile": False}
    assert outcome(run)["status"] == "completed" and outcome(run)["value"] is not None
    bare_test = [r for r in rows(bare / "metrics.csv") if "test/acc" in r]
    mine_test = [r for r in rows(run / "metrics.csv") if "test/acc" in r]
    assert_same_rows(mine_test, bare_test)  # the best checkpoint, tested as bare Lightning tests it

    env = _env(tmp_path / "later")
    logs = tmp_path / "later" / "logs"
    resumed = train(
        logs,
        *template_overrides(CASES["net_in_hparams"]),
        f"ckpt_path={last}",
        "trainer.max_epochs=4",
        env=env,
    )
    assert_ok(resumed)
    assert last_checkpoint(run_dirs(logs)[0])[0] == 3  # a fourth epoch after the three it resumed
    common = (f"paths.log_dir={logs}", "extras.print_config=false", f"ckpt_path={last}")
    common += (*reader_overrides(CASES["net_in_hparams"]),)  # its classes and keys, named again
    evaluated = run_entry("eval.py", *common, env=env)
    assert_ok(evaluated)
    assert "Please add the following callbacks" not in evaluated.stdout  # the template's own, not the user's
    (eval_run,) = run_dirs(logs, "eval")
    assert outcome(eval_run)["metric"] == "val/acc"  # what the checkpoint was trained to watch
    for entry in ("predict.py", "export.py"):
        assert_ok(run_entry(entry, *common, env=env))
    tuned = train(
        logs,
        *template_overrides(CASES["net_in_hparams"]),
        f"init_from.path={last}",
        "trainer.max_epochs=1",
        env=env,
    )
    assert_ok(tuned)
    assert "init_from: loaded 4 of the model's 4 tensors" in tuned.stdout

    import hpctrain

    model = hpctrain.load(last, reader_overrides(CASES["net_in_hparams"]))
    assert model(torch.zeros(2, 64)).shape == (2, 10)


def test_a_model_that_logs_nothing_trains_with_last_ckpt_only(tmp_path: Path):
    """Lightning's demo BoringModel and BoringDataModule, by config only: nothing is logged, so nothing
    can be monitored; the run keeps last.ckpt only (as a bare Trainer with a plain ModelCheckpoint),
    says so once, and tests last.ckpt."""
    _, run = trained_as_under_bare_lightning("logs_nothing", tmp_path)
    log = (run / "train.log").read_text()
    assert log.count("the model logs no metric, so monitor.metric=val/acc cannot be followed") == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    assert f"last checkpoint: {run / 'checkpoints' / 'last.ckpt'}" in log  # the one tested after fit
    assert outcome(run) | {"metric": None, "value": None, "status": "completed"} == outcome(run)


def test_several_validation_sets_are_monitored_by_their_suffixed_names(tmp_path: Path):
    """Lightning names a metric once per validation dataloader (val_loss/dataloader_idx_N) and has
    cleared the sanity check's metrics when it ends; a suffixed name is monitored as under bare
    Lightning, and the unsuffixed one is refused naming the suffixed ones."""
    trained_as_under_bare_lightning("two_val_sets", tmp_path)
    refused = train(
        tmp_path / "refused",
        *template_overrides(CASES["two_val_sets"]),
        "monitor.metric=val_loss",
        env=_env(tmp_path / "refused"),
    )
    assert refused.returncode == 2, refused.stdout[-3000:]
    (error,) = [line for line in refused.stdout.splitlines() if line.startswith("error: ")]
    assert "it logged: train_loss, val_loss/dataloader_idx_0, val_loss/dataloader_idx_1" in error
    assert (
        "with several validation dataloaders pass one of them, e.g. monitor.metric=val_loss/dataloader_idx_0"
        in error
    )


def test_early_stopping_leaves_the_last_epoch_in_last_ckpt(tmp_path: Path):
    """Under bare Lightning 2.6, last.ckpt is written only together with a new best: after early
    stopping it holds the best epoch, and a restart from it would redo every epoch since. Here it holds
    the epoch where training stopped."""
    bare = run_bare("early_stopping", tmp_path / "bare")
    run = run_template("early_stopping", tmp_path / "template")
    ended = hooks(bare)["hooks-rank0.json"]["notes"]["last_epoch_end"]
    assert ended[0] < 7, "early stopping did not stop early: the case no longer tests it"
    assert list(last_checkpoint(run)[:2]) == ended
    assert list(last_checkpoint(bare)[:2]) != ended  # Lightning's own: the best epoch (the difference named)


def test_custom_checkpoint_state_survives_a_resume_as_under_bare_lightning(tmp_path: Path):
    """on_save_checkpoint / on_load_checkpoint state comes back as under bare Lightning, with the same hooks.
    Deliberate difference: the template also restores every rank's random state, so its resumed run
    logs what the uninterrupted run logs (bare Lightning's resumed run draws other dropout masks)."""
    name = "checkpoint_state_resume"
    bare1 = run_bare(name, tmp_path / "bare1", "--max-epochs", "2")
    bare2 = run_bare(
        name, tmp_path / "bare2", "--max-epochs", "4", "--ckpt-path", str(bare1 / "checkpoints" / "last.ckpt")
    )
    uninterrupted = run_bare(name, tmp_path / "bare_full", "--max-epochs", "4")
    run1 = run_template(name, tmp_path / "template1", trainer={"max_epochs": 2})
    run2 = run_template(
        name,
        tmp_path / "template2",
        f"ckpt_path={run1 / 'checkpoints' / 'last.ckpt'}",
        trainer={"max_epochs": 4},
    )
    notes = hooks(tmp_path / "template2")["hooks-rank0.json"]["notes"]
    assert notes["loaded_epochs_seen"] == [2, 4] and notes["epochs_seen"] == 4  # resumed, then tested
    assert (
        notes["callback_loaded_epochs"][0] == 2 and notes["callback_epochs"] == 4
    )  # a stateful callback too
    assert hooks(tmp_path / "template2") == hooks(bare2)
    resumed_part = [r for r in rows(uninterrupted / "metrics.csv") if int(r["epoch"]) >= 2]
    assert_same_rows(rows(run2 / "metrics.csv"), resumed_part)


def test_onecycle_resumed_mid_epoch_ends_as_the_uninterrupted_run(tmp_path: Path):
    """A per-step OneCycleLR reads trainer.estimated_stepping_batches, which builds the train loader before
    Lightning restores the checkpoint (Lightning #20550): bare Lightning then re-reads the resumed epoch
    from its start. The template's run, interrupted at step 25 (mid-way through the second epoch) and
    resumed, ends with the uninterrupted bare run's weights and metrics."""
    name = "onecycle_mid_epoch_resume"
    bare = run_bare(name, tmp_path / "bare")
    saved = tmp_path / "step25.ckpt"
    save_at = {
        "save_at": {"_target_": "tests.differential.user_code.SaveAtStep", "step": 25, "path": str(saved)}
    }
    run_template(name, tmp_path / "template1", extra_callbacks=save_at)
    assert saved.is_file()
    run = run_template(name, tmp_path / "template2", f"ckpt_path={saved}")

    final = torch.load(bare / "final.pt", weights_only=True)
    resumed = last_checkpoint(run)[2]["state_dict"]
    assert final.keys() == resumed.keys()
    for key in final:
        assert torch.equal(final[key], resumed[key]), key
    after = [r for r in rows(bare / "metrics.csv") if int(r["step"]) > 25]
    assert_same_rows([r for r in rows(run / "metrics.csv") if int(r["step"]) > 25], after)


def best_state(checkpoint: Path) -> tuple[str, float]:
    """The best checkpoint's path and score that a checkpoint's ModelCheckpoint state names."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("ModelCheckpoint")]
    return state["best_model_path"], float(state["best_model_score"])


def test_the_best_checkpoint_before_a_resume_stays_the_best_in_the_new_run_dir(tmp_path: Path):
    """The module's validation accuracy peaks at epoch 1; a run stopped after epoch 2 and resumed into a new
    run dir (as ckpt_path always is) for epoch 3 ends as the uninterrupted bare run: its best checkpoint is
    epoch 1's (in the earlier run dir, where it stays), with the score val_acc_best and the sweep's value
    say, and the test after fit tests it. Bare Lightning's own resume into a new dirpath keeps only the old
    best's path: its first validation after the resume becomes the best, worse than val_acc_best."""
    name = "best_before_resume"
    full = run_bare(name, tmp_path / "bare")
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["epoch_001.ckpt", "last.ckpt"]
    peak = max(float(r["val_acc"]) for r in rows(full / "metrics.csv") if "val_acc" in r)
    assert best_state(full / "checkpoints" / "last.ckpt")[1] == pytest.approx(peak)

    first = run_template(name, tmp_path / "template1", trainer={"max_epochs": 3})
    resumed = run_template(name, tmp_path / "template2", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    earlier_best = first / "checkpoints" / "epoch_001.ckpt"
    assert earlier_best.is_file()  # never removed from the earlier run dir
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["last.ckpt"]  # epoch 3 is worse
    path, score = best_state(resumed / "checkpoints" / "last.ckpt")
    assert path == str(earlier_best) and score == pytest.approx(peak)
    mine = rows(resumed / "metrics.csv")
    assert last_value_of(mine, "val_acc_best") == pytest.approx(peak)
    assert outcome(resumed)["value"] == pytest.approx(peak)  # what a sweeper gets
    assert f"best checkpoint: {earlier_best}" in (resumed / "train.log").read_text()  # tested after fit
    assert_same_rows(mine, [r for r in rows(full / "metrics.csv") if int(r["epoch"]) >= 3])  # test_acc too

    stopped = run_bare(name, tmp_path / "bare1", "--max-epochs", "3")
    moved = run_bare(name, tmp_path / "bare2", "--ckpt-path", str(stopped / "checkpoints" / "last.ckpt"))
    bare_path, bare_score = best_state(moved / "checkpoints" / "last.ckpt")
    assert Path(bare_path).parent == moved / "checkpoints" and bare_score < peak  # Lightning's own, named
    assert last_value_of(rows(moved / "metrics.csv"), "val_acc_best") == pytest.approx(peak)


def last_value_of(found: list[dict[str, str]], key: str) -> float:
    return [float(r[key]) for r in found if key in r][-1]
