"""Public Lightning code, put into the template as its guides say, runs as it runs under bare Lightning.

tests/differential/corpus.py holds code in the styles users bring (Lightning's GAN and fine-tuning
examples, a Hydra-zen template's MetricCollection model, a PyPI library's linear classifier, an EMA
callback on Lightning's WeightAveraging, the UvA tutorial's Transformer with data from
`LightningDataModule.from_datasets`); its model and data configs are files of conf/ written as Hydra
users write them (`torch.nn.Sequential` with `_args_`, `torch.optim.Adam` with `_partial_`, a classmethod).
Each is, beside a bare Trainer of the package it is written with (tests/differential/bare.py):

- fit: every hook of the recorder, every row of metrics.csv and where training ended are the same, and
  the template prints no warning that bare Lightning does not (its documented performance advice aside);
- resumed from its checkpoint of the first epoch's end: the later epochs' rows and the final weights are
  the uninterrupted bare run's (its optimizer's param groups too, across the fine-tuning milestones);
- under DDP (2 processes): the same hooks on every rank and the same rows;
- evaluated (src/eval.py): the checkpoint's validation metrics are those the run logged for it; a model
  with no test_step is evaluated on its validation split and says so, one with neither is one sentence.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.differential.cases import (
    CASES,
    CONF,
    CORPUS_CASES,
    CORPUS_WRITTEN_WITH_LIGHTNING,
    SEED,
    template_overrides,
)
from tests.helpers import assert_ok, read_metrics, run_dirs, run_entry, run_script, train
from tests.test_differential import _env, assert_same_rows, hooks, last_checkpoint, rows

pytestmark = pytest.mark.slow

# what the template prints of its own accord and documents as performance advice (docs/guides/hangs-and-speed.md)
ADVICE = ("input-bound: ",)


def bare(case: str, out: Path, *args: str, package: str) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    _backbone(out)
    result = run_script(
        "tests/differential/bare.py", case, str(out), *args, "--package", package, env=_env(out)
    )
    assert_ok(result)
    return result


def template(
    case: str, out: Path, *overrides: str, package: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out.mkdir(parents=True, exist_ok=True)
    _backbone(out)
    result = train(out / "logs", *template_overrides(CASES[case], package=package), *overrides, env=_env(out))
    assert_ok(result)
    (run,) = run_dirs(out / "logs")
    return run, result


def _backbone(out: Path) -> None:
    """The fine-tuning example's "pretrained" backbone, where its config reads it (${oc.env:DIFF_OUT})."""
    from tests.differential.corpus import backbone

    torch.manual_seed(0)
    torch.save(backbone().state_dict(), out / "backbone.pt")


def printed_warnings(stdout: str) -> set[str]:
    """The warnings a run printed (Python's, Lightning's, and log records at WARNING), their numbers and
    paths left out."""
    found = set()
    for line in stdout.splitlines():
        # Python's format, Lightning's (`<file>:<line>: <message>`), and a log record's
        match = re.search(r"(?:\w+Warning: |^\S+\.py:\d+: |\[WARNING\] - )(.*)", line)
        if match:
            text = re.sub(r"^\w+Warning: ", "", match.group(1))
            found.add(re.sub(r"/\S+|\d+(\.\d+)?", "#", text).strip())
    return found


def assert_no_warning_bare_does_not_print(
    template_run: subprocess.CompletedProcess[str], bare_run: subprocess.CompletedProcess[str]
) -> None:
    extra = printed_warnings(template_run.stdout) - printed_warnings(bare_run.stdout)
    extra = {warning for warning in extra if not warning.startswith(ADVICE)}
    assert not extra, f"warnings bare Lightning does not print: {sorted(extra)}"


def package_of(name: str) -> str:
    return "lightning" if name in CORPUS_WRITTEN_WITH_LIGHTNING else "pytorch_lightning"


@pytest.mark.parametrize("name", sorted(CORPUS_CASES))
def test_public_code_fits_resumes_and_evaluates_as_under_bare_lightning(name: str, tmp_path: Path):
    case, package = f"corpus_{name}", package_of(name)
    said_bare = bare(case, tmp_path / "bare", package=package)
    run, said = template(case, tmp_path / "template", package=package)

    assert hooks(tmp_path / "template") == hooks(tmp_path / "bare")  # every hook, and where training ended
    assert_same_rows(rows(run / "metrics.csv"), rows(tmp_path / "bare" / "metrics.csv"))
    notes = hooks(tmp_path / "bare")["hooks-rank0.json"]["notes"]
    assert list(last_checkpoint(run)[:2]) == notes["last_epoch_end"]
    if name == "finetuning":  # its constructor reads its backbone's file and counts itself: once, as bare
        assert notes["inits"] == 1
    assert_no_warning_bare_does_not_print(said, said_bare)
    # the template's checkpoints load with weights_only=True (bare Lightning's may not: the transformer's)
    for checkpoint in (run / "checkpoints").glob("*.ckpt"):
        torch.load(checkpoint, map_location="cpu", weights_only=True)

    # resumed from the end of the first epoch (before the fine-tuning milestones: Lightning's BaseFinetuning
    # gives the optimizer back its param groups on a resume, but not the trainable flags of the layers an
    # earlier milestone unfroze): the next epochs as the uninterrupted bare run's
    resumed, _ = template(
        case, tmp_path / "resumed", f"ckpt_path={run / 'checkpoints' / 'epoch_000.ckpt'}", package=package
    )
    later = [r for r in rows(tmp_path / "bare" / "metrics.csv") if int(r["epoch"]) >= 1]
    assert_same_rows([r for r in rows(resumed / "metrics.csv") if int(r["epoch"]) >= 1], later)
    final = torch.load(tmp_path / "bare" / "final.pt", weights_only=True)
    saved = last_checkpoint(resumed)[2]  # with EMA, the averaged weights (bare's model holds them after fit)
    assert final.keys() == saved["state_dict"].keys()
    assert all(torch.equal(final[k], saved["state_dict"][k]) for k in final)
    groups = [[(g["lr"], len(g["params"])) for g in o["param_groups"]] for o in saved["optimizer_states"]]
    uninterrupted = last_checkpoint(run)[2]["optimizer_states"]
    assert groups == [[(g["lr"], len(g["params"])) for g in o["param_groups"]] for o in uninterrupted]

    evaluated = evaluate(name, resumed, tmp_path / "eval")
    if name == "gan":  # no test_step, no validation_step
        assert evaluated.returncode == 2, evaluated.stdout[-3000:]
        (error,) = [line for line in evaluated.stdout.splitlines() if line.startswith("error: ")]
        assert (
            "nothing to evaluate: the model has no test_step, and the model has no validation_step" in error
        )
        return
    assert_ok(evaluated)
    if CASES[case].model_file in ("finetuning", "ema_classifier"):  # no test_step: its validation split
        assert "eval: the model has no test_step, so the checkpoint is evaluated on the validation split" in (
            evaluated.stdout
        )
        refused = evaluate(name, resumed, tmp_path / "refused", "eval.split=test")
        assert refused.returncode == 2, refused.stdout[-3000:]
        assert (
            "error: eval.split=test, but the model has no test_step; pass eval.split=val." in refused.stdout
        )
    (eval_run,) = run_dirs(tmp_path / "eval", "eval")
    logged = {k: v for r in read_metrics(eval_run) for k, v in r.items() if k.startswith("val") and v}
    last_epoch = [r for r in rows(resumed / "metrics.csv") if any(k.startswith("val") for k in r)][-1]
    assert logged and all(float(logged[k]) == pytest.approx(float(last_epoch[k]), rel=1e-6) for k in logged)


def evaluate(name: str, run: Path, logs: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """src/eval.py on the run's last.ckpt, as its user types it: the configs' folder, the checkpoint, and the
    training's seed (the tutorial's data is drawn at random when it is built). The checkpoint proposes its
    options and values; the fine-tuning example's backbone path is this machine's, as its config reads it."""
    split = [] if name in ("gan", "finetuning", "ema") else ["eval.split=val"]
    logs.mkdir(parents=True, exist_ok=True)
    _backbone(logs)
    return run_entry(
        "eval.py",
        f"hydra.searchpath=[file://{CONF}]",
        f"paths.log_dir={logs}",
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"seed={SEED}",
        *(overrides or split),
        env=_env(logs),
    )


@pytest.mark.parametrize("name", sorted(CORPUS_CASES))
def test_public_code_under_ddp_runs_as_under_bare_lightning(name: str, tmp_path: Path):
    case, package = f"corpus_{name}_ddp", package_of(name)
    said_bare = bare(case, tmp_path / "bare", "--max-epochs", "1", package=package)
    run, said = template(case, tmp_path / "template", "trainer.max_epochs=1", package=package)
    assert_no_warning_bare_does_not_print(said, said_bare)
    assert hooks(tmp_path / "template") == hooks(tmp_path / "bare")
    assert len(hooks(tmp_path / "bare")) == 2
    assert_same_rows(rows(run / "metrics.csv"), rows(tmp_path / "bare" / "metrics.csv"))


def test_images_logged_as_lightnings_gan_example_logs_them_are_files_of_the_run(tmp_path: Path):
    """The GAN's samples (`logger.experiment.add_image`, TensorBoard's call) under the default csv logger:
    one PNG per epoch in the run dir (bare Lightning's CSVLogger raises an AttributeError there)."""
    run, _ = template("corpus_gan", tmp_path / "template", "trainer.max_epochs=2", package="lightning")
    images = sorted(p.relative_to(run).as_posix() for p in (run / "images").rglob("*.png"))
    assert images == ["images/generated_images/000000.png", "images/generated_images/000001.png"]


def test_a_model_without_validation_is_told_its_monitored_metric_is_missing_after_its_first_epoch(
    tmp_path: Path,
):
    """Lightning's GAN example logs g_loss and d_loss while training and never validates: with the template's
    default monitor (val/acc) that is one sentence at the end of the first epoch, not after the whole fit."""
    out = tmp_path / "template"
    overrides = template_overrides(CASES["corpus_gan"], package="lightning")
    result = train(out / "logs", *overrides, "monitor.metric=val/acc", "trainer.max_epochs=5", env=_env(out))
    assert result.returncode == 2, result.stdout[-3000:]
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert "monitor.metric=val/acc is never logged by the model (it logged: d_loss, g_loss)" in error
    (run,) = run_dirs(out / "logs")
    assert {row["epoch"] for row in read_metrics(run) if row["epoch"]} == {"0"}
