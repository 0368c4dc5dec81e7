"""This project end to end, as you run it: hpctrain as recorded, a real training run, a two-node Slurm job.
(Your model x data pair is checked by tests/contract: one batch, checkpoints, DDP on CPU, resume.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpctrain.testing import untouched

ROOT = Path(__file__).resolve().parents[1]
QUICK = ("experiment=quickstart", "trainer.max_epochs=2")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def test_hpctrain_is_carried_untouched():
    sentence = untouched.check(ROOT / "src")
    assert sentence is None, sentence


@pytest.mark.slow
def test_a_short_training_run_trains_tests_and_keeps_its_checkpoint(tmp_path: Path):
    command = [
        sys.executable,
        "src/train.py",
        *QUICK,
        f"paths.log_dir={tmp_path}",
        "extras.print_config=false",
    ]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = (tmp_path / "train" / "runs").iterdir()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert yaml.safe_load((run / "outcome.yaml").read_text())["status"] == "completed"


@pytest.mark.slow
@pytest.mark.slurm
def test_a_two_node_slurm_job_trains(slurm_cluster, tmp_path: Path):
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        *("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=2G", "--gres=none"),
        "slurm/train.sbatch",
        "trainer=ddp_cpu",
        *QUICK,
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    info = slurm_cluster.wait(job, timeout_s=300)
    output = "".join(p.read_text() for p in tmp_path.glob(f"*-{job}.out"))
    assert info["JobState"] == "COMPLETED", output[-4000:]
    assert "processes: 2 (process group backend: gloo)" in output
    assert (tmp_path / "train" / "runs" / f"slurm-{job}" / "checkpoints" / "last.ckpt").is_file()
