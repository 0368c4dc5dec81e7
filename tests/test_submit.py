"""scripts/submit.py renders one consistent sbatch command and passes arguments without a shell."""

from __future__ import annotations

import shlex
import subprocess

from tests.helpers import PYTHON, ROOT


def _dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, str(ROOT / "scripts" / "submit.py"), "--dry-run", *args], capture_output=True, text=True
    )


def _flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def test_gpu_counts_come_from_one_place():
    result = _dry_run(
        "--nodes", "10", "--gpus-per-node", "8", "--time", "12:00:00", "--", "experiment=mnist_cnn"
    )
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip())
    flags = _flags(command)
    assert (flags["nodes"], flags["ntasks-per-node"], flags["gres"], flags["time"]) == (
        "10",
        "8",
        "gpu:8",
        "12:00:00",
    )
    assert command[-2:] == [str(ROOT / "slurm" / "train.sbatch"), "experiment=mnist_cnn"]


def test_cpu_cluster_gets_gloo_ddp_and_no_gres():
    command = shlex.split(_dry_run("--nodes", "2", "--cpu", "--", "experiment=quickstart").stdout)
    flags = _flags(command)
    assert (flags["nodes"], flags["ntasks-per-node"], flags["gres"]) == ("2", "1", "none")
    assert command[-2:] == ["trainer=ddp_cpu", "experiment=quickstart"]


def test_arguments_reach_sbatch_verbatim_without_a_shell(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [f"$(touch {marker})", "tags=[a;b]", "name='two words'"]
    result = _dry_run("--nodes", "1", "--", *hostile)
    assert shlex.split(result.stdout)[-3:] == hostile  # the printed command round-trips exactly
    assert not marker.exists()


def test_counts_cannot_be_overridden_twice():
    result = _dry_run("--nodes", "2", "--", "trainer.num_nodes=4")
    assert result.returncode == 2 and "trainer.num_nodes=4 is set from --nodes" in result.stderr
