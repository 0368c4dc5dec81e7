"""`python src/train.py` and `python src/eval.py` as a user runs them: real processes, real outputs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpctrain.runtime.report import console
from tests.helpers import (
    PYTHON,
    ROOT,
    assert_ok,
    last_value,
    local_env,
    metrics_without_timing,
    read_metrics,
    run_dirs,
    run_entry,
    train,
)

pytestmark = pytest.mark.slow

DIGITS = ("data=digits", "trainer=cpu", "logger=csv")


def _imported_modules(*args: str) -> set[str]:
    result = subprocess.run(
        [PYTHON, "-X", "importtime", str(ROOT / "src" / "train.py"), *args],
        capture_output=True,
        text=True,
        env=local_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }


def test_help_lists_the_config_groups_without_importing_torch():
    modules = _imported_modules("--help")
    assert not {"torch", "pytorch_lightning", "torchvision"} & modules
    out = subprocess.run(
        [PYTHON, "src/train.py", "--help"], capture_output=True, text=True, cwd=ROOT, env=local_env()
    ).stdout
    for group in ("data", "model", "model/net", "experiment", "trainer"):
        options = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in out


def test_cfg_job_composes_without_importing_torch():
    assert not {"torch", "pytorch_lightning"} & _imported_modules("--cfg", "job", "experiment=quickstart")


def _one_sentence_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
    return errors[0]


def test_unknown_override_key_fails_naming_the_key(tmp_path: Path):
    message = _one_sentence_error(train(tmp_path, "trainer.max_epoch=3"))
    assert "trainer.max_epoch is not a config key; did you mean trainer.max_epochs=3?" in message
    assert not (tmp_path / "train").exists()  # nothing was started


def test_wrong_type_is_one_sentence(tmp_path: Path):
    message = _one_sentence_error(train(tmp_path, *DIGITS, "trainer.max_epochs=ten"))
    assert "trainer.max_epochs='ten' is not an integer" in message
    message = _one_sentence_error(train(tmp_path, *DIGITS, "data.batch_size=0"))
    assert "data.batch_size=0 is not a positive integer" in message


def test_missing_checkpoint_is_one_sentence(tmp_path: Path):
    message = _one_sentence_error(train(tmp_path, *DIGITS, f"ckpt_path={tmp_path}/nope.ckpt"))
    assert f"ckpt_path={tmp_path}/nope.ckpt does not exist" in message
    message = _one_sentence_error(
        run_entry("eval.py", f"paths.log_dir={tmp_path}", f"ckpt_path={tmp_path}/nope.ckpt")
    )
    assert "does not exist" in message


def test_bf16_on_a_cpu_that_emulates_it_is_named_at_the_start(tmp_path: Path):
    result = train(tmp_path, *DIGITS, "model=mlp", "debug=fdr", "trainer.precision=bf16-mixed")
    assert_ok(result)
    notes = [line for line in result.stdout.splitlines() if "runs in emulation" in line]
    flags = console.cpu_flags()
    native = sorted((flags or set()) & console.NATIVE_BF16_FLAGS)
    if flags is None or native:
        assert not notes, notes  # nothing to say where bf16 is native, or where the flags are unknown
        reason = f"this CPU has native bf16 ({', '.join(native)})" if native else "no /proc/cpuinfo"
        pytest.skip(f"{reason}: the note is rightly absent; test_config.py covers the emulated case")
    (note,) = notes
    assert "trainer.precision=bf16-mixed on a CPU without native bf16" in note
    assert "pass trainer.precision=32-true" in note
    assert result.stdout.index(note) < result.stdout.index("first training step")


def test_quickstart_reaches_90_percent_test_accuracy(quickstart_run: Path):
    """The README's first run (the session's `quickstart_run`, whole): its accuracy and its files."""
    run = quickstart_run
    assert last_value(read_metrics(run), "test/acc") >= 0.90
    for name in ("config.yaml", "run.yaml", "metrics.csv", ".hydra/overrides.yaml", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), name
    record = (run / "run.yaml").read_text()
    assert "pytorch-lightning:" in record and "commit:" in record and "experiment=quickstart" in record


def test_same_command_gives_the_same_metrics(tmp_path: Path):
    """Run once in a fresh interpreter and once forked from the tests' preloaded one (tests/preload.py):
    the same metrics, so a run does not depend on which of the two started it (two short epochs, every
    step logged)."""
    short = ("trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2")
    for attempt, fresh in (("a", True), ("b", False)):
        assert_ok(train(tmp_path / attempt, *DIGITS, *short, "trainer.log_every_n_steps=1", fresh=fresh))
    a, b = (metrics_without_timing(run_dirs(tmp_path / x)[0]) for x in ("a", "b"))
    assert a == b and len(a) > 3


def test_train_then_eval_the_checkpoint(quickstart_run: Path, tmp_path: Path):
    trained_acc = last_value(read_metrics(quickstart_run), "test/acc")  # the test after fit, on the best
    best = next((quickstart_run / "checkpoints").glob("epoch_*.ckpt"))
    # eval rebuilds model and data from the checkpoint: no model=/data= needed
    result = run_entry(
        "eval.py", f"paths.log_dir={tmp_path}", f"ckpt_path={best}", "extras.print_config=false"
    )
    assert_ok(result)
    (eval_run,) = run_dirs(tmp_path, task="eval")
    assert last_value(read_metrics(eval_run), "test/acc") == pytest.approx(trained_acc, abs=1e-6)


def test_resume_from_last_checkpoint(tmp_path: Path):
    short = ("trainer.limit_train_batches=3", "trainer.limit_val_batches=2", "test=false")
    assert_ok(train(tmp_path, *DIGITS, *short, "trainer.max_epochs=2"))
    result = train(tmp_path, *DIGITS, *short, "trainer.max_epochs=4", "ckpt_path=last")
    assert_ok(result)
    first, second = run_dirs(tmp_path)
    assert (
        f"starting from {first}/checkpoints/last.ckpt (ckpt_path=last: the newest earlier run)"
        in result.stdout
    )
    epochs = {int(row["epoch"]) for row in read_metrics(second) if row.get("train/acc")}
    assert epochs == {2, 3}  # continued where the first run stopped
