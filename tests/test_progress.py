"""Progress output: a live rich bar on a terminal, plain periodic lines in a file (SLURM logs)."""

from __future__ import annotations

import os
import pty
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, ROOT, local_env

pytestmark = pytest.mark.slow

# Two short epochs: what is printed at a step, at the end of an epoch and after a validation, twice
ARGS = (
    "experiment=quickstart",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "test=false",
    "extras.print_config=false",
    "callbacks.progress.log_every_n_s=0",
)


def test_output_to_a_file_is_plain_log_lines(tmp_path: Path):
    log = tmp_path / "job.out"
    with open(log, "w") as out:  # like `#SBATCH --output`
        subprocess.run(
            [PYTHON, "src/train.py", f"paths.log_dir={tmp_path}", *ARGS],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=local_env(),
            check=True,
            timeout=300,
        )
    text = log.read_text()
    assert "\r" not in text and "\x1b[" not in text  # no redrawn bars, no terminal escapes
    assert "epoch 1/2  step 3/3 (100%)" in text and "samples/s" in text
    (line,) = [x for x in text.splitlines() if "epoch 1 validation  " in x]
    assert "val/acc " in line and "val/loss " in line  # the monitored metric first, then what was logged


def test_a_terminal_gets_a_live_rich_bar(tmp_path: Path):
    leader, follower = pty.openpty()
    env = {**local_env(), "TERM": "xterm-256color", "COLUMNS": "120"}
    process = subprocess.Popen(
        [PYTHON, "src/train.py", f"paths.log_dir={tmp_path}", *ARGS],
        stdout=follower,
        stderr=follower,
        cwd=ROOT,
        env=env,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=300) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in text and "Epoch 1/1" in text  # rich redraws its bar in place
    assert "step 3/3 (100%)" not in text  # and the log-line progress is not used
