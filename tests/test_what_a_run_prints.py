"""What a newcomer reads first: a run starts with a few lines of its config (the whole tree is in
config.yaml, and printed with extras.print_config=full), and each entry point's --help ends with its own
examples."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from hpctrain.runtime.config import help_text
from hpctrain.runtime.config.checks import check_config
from hpctrain.runtime.config.compose import CONF_DIR, compose
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.report.console import config_summary
from tests.helpers import run_entry, train

ENTRIES = ("train", "eval", "predict", "export")


def test_the_summary_is_a_few_lines_that_name_the_options_the_classes_and_where_the_rest_is(tmp_path: Path):
    cfg = compose("train", ["experiment=quickstart", f"paths.output_dir={tmp_path}"])
    choices = {"experiment": "quickstart", "model": "mnist_cnn", "data": "digits", "hydra/launcher": "basic"}
    lines = config_summary(cfg, choices, ["experiment=quickstart", "seed=7"])
    text = "\n".join(lines)
    assert len(lines) <= 10
    assert f"{tmp_path}/config.yaml" in lines[0] and "extras.print_config=full" in lines[0]
    assert "experiment=quickstart model=mnist_cnn data=digits" in text and "hydra/launcher" not in text
    assert "overrides  experiment=quickstart seed=7" in text
    assert re.search(
        r"model +myproject\.models\.classifier\.ImageClassifier \(net \w+, optimizer Adam\)", text
    )
    assert re.search(r"data +myproject\.data\.digits\.DigitsDataModule \(batch_size \d+", text)
    assert re.search(r"trainer +cpu x 1 device\(s\) x 1 node\(s\), strategy auto, precision 32-true", text)
    assert "monitor    val/acc (max)" in text and f"run dir    {tmp_path}" in text


def test_the_summary_repeats_no_secret(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SECRET_WORD", "hunter2")
    cfg = compose("train", ["experiment=quickstart", "+data.token=${oc.env:SECRET_WORD}"])
    text = "\n".join(config_summary(cfg, {}, ["+data.token=${oc.env:SECRET_WORD}"]))
    assert "hunter2" not in text


def test_print_config_takes_summary_full_or_false(tmp_path: Path):
    def checked(*overrides: str):
        outputs = [f"paths.output_dir={tmp_path / 'run'}", f"paths.log_dir={tmp_path}"]
        return check_config(compose("train", ["experiment=quickstart", *outputs, *overrides]))

    for value in ("summary", "full", "false", "true"):
        assert checked(f"extras.print_config={value}").extras.print_config == {
            "false": False,
            "true": True,
        }.get(value, value)
    assert checked().extras.print_config == "summary"
    with pytest.raises(UserError, match=r"extras\.print_config='tree' is not summary, full or false"):
        checked("extras.print_config=tree")


def _help(entry: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = ["ckpt_path=X"] if entry != "train" else []
        return hydra_compose(entry, overrides, return_hydra_config=True).hydra.help


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_entry_points_help_ends_with_its_own_examples(entry: str):
    shown = _help(entry)
    assert shown.header.splitlines()[:2] == [f"== {entry} ==", shown.header.splitlines()[1]]
    assert f"python src/{entry}.py [group=option ...]" in shown.header
    examples = [line.strip() for line in shown.footer.splitlines()[1:] if line.startswith("  ")]
    assert examples and examples == help_text.EXAMPLES[entry]
    for line in examples:
        others = [e for e in ENTRIES if e != entry and f"src/{e}.py" in line]
        assert not others, line
        assert f"src/{entry}.py" in line or (entry == "train" and "slurm/train.sbatch" in line)


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_help_examples_compose(entry: str):
    """Each example's overrides compose as its entry point composes them (placeholders given a value)."""
    for line in help_text.EXAMPLES[entry]:
        words = line.split("#")[0].split()
        start = next(i for i, w in enumerate(words) if w.endswith((".py", ".sbatch"))) + 1
        overrides = [
            re.sub(r"<[^>]+>", "X", w).split(",")[0]
            for w in words[start:]
            if "=" in w and not w.startswith("-")
        ]
        compose(entry, overrides)


@pytest.mark.slow
def test_help_after_another_entry_points_help_is_still_its_own(tmp_path: Path):
    """The stored answer of train.py --help is never eval.py's (the answer's key names the entry point)."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    for entry in ("train", "eval"):  # train.py stores its answer first
        result = run_entry(f"{entry}.py", "--help", env=env)
        assert result.returncode == 0, result.stdout[-2000:]
        assert result.stdout.startswith(f"== {entry} ==")
        assert f"python src/{entry}.py ckpt_path" in result.stdout or entry == "train"
        other = "eval" if entry == "train" else "train"
        assert f"python src/{other}.py" not in result.stdout.split("Examples:")[1]


@pytest.mark.slow
def test_a_run_prints_its_summary_not_the_tree_and_the_tree_when_asked(tmp_path: Path):
    tiny = ("experiment=quickstart", "train=false", "test=false")
    quiet = train(tmp_path / "a", *tiny, "extras.print_config=summary")
    assert quiet.returncode == 0, quiet.stdout[-3000:]
    assert "config (all of it: " in quiet.stdout and "├──" not in quiet.stdout
    assert "  model      myproject.models.classifier.ImageClassifier" in quiet.stdout
    full = train(tmp_path / "b", *tiny, "extras.print_config=full")
    assert full.returncode == 0, full.stdout[-3000:]
    assert "├── model" in full.stdout and "config (all of it: " not in full.stdout


@pytest.mark.slow
def test_a_readers_summary_names_the_options_its_checkpoint_proposed(trained_run: Path, tmp_path: Path):
    """eval's own config defaults to data=mnist; the quickstart checkpoint was trained on digits, and what
    eval composes from its proposal, and so prints, is digits."""
    result = run_entry(
        "eval.py", f"ckpt_path={trained_run / 'checkpoints' / 'last.ckpt'}", f"paths.log_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    (options,) = [line for line in result.stdout.splitlines() if line.startswith("  options ")]
    assert " data=digits" in options and "data=mnist" not in options, options
    assert " model=mnist_cnn" in options
    assert "myproject.data.digits.DigitsDataModule" in result.stdout
