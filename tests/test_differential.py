"""Your own code behaves as under bare Lightning: each case of tests/differential/cases.py is trained by a
plain `pl.Trainer` script and by `python src/train.py`, and what a user observes is compared: which
hooks ran and how often (per rank), every row of metrics.csv, the test metrics, and the epoch and step
that last.ckpt holds. Values are compared with a relative tolerance of 1e-6 (they are equal on CPU).

Where the template deliberately differs, the test says so: its run dir and progress output, and
last.ckpt, which here always holds the newest state (bare Lightning 2.6 may leave the best epoch's there).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from tests.differential.cases import CASES, template_overrides
from tests.helpers import ROOT, assert_ok, run_dirs, run_script, train

pytestmark = pytest.mark.slow

SINGLE_RUN = [name for name in CASES if name not in ("checkpoint_state_resume", "onecycle_mid_epoch_resume")]


def _env(out: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "DIFF_OUT": str(out)}


def run_bare(case: str, out: Path, *args: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    assert_ok(run_script("tests/differential/bare.py", case, str(out), *args, env=_env(out)))
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
    with open(metrics_csv, newline="") as file:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(file)]


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


@pytest.mark.parametrize("name", SINGLE_RUN)
def test_user_code_behaves_as_under_bare_lightning(name: str, tmp_path: Path):
    bare = run_bare(name, tmp_path / "bare")
    mine = tmp_path / "template"
    run = run_template(name, mine)

    assert hooks(mine) == hooks(bare)  # every hook, every rank, as often (and where training ended)
    assert len(hooks(bare)) == CASES[name].processes
    assert_same_rows(rows(run / "metrics.csv"), rows(bare / "metrics.csv"))
    # Deliberate difference: last.ckpt holds where training ended (the bare run's last epoch end),
    # whether or not the monitored metric improved there.
    ended = hooks(bare)["hooks-rank0.json"]["notes"]["last_epoch_end"]
    assert list(last_checkpoint(run)[:2]) == ended


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
