"""scripts/submit.py renders one consistent sbatch command and passes arguments without a shell (its `main`,
in this process: the Slurm tests run the script)."""

from __future__ import annotations

import shlex
import subprocess

from tests.helpers import ROOT, submit_in_process, submit_script


def _dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return submit_in_process("--dry-run", *args)


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


def _submit():
    return submit_script()


def _never_fits(**flags: str) -> str | None:
    submit = _submit()
    nodes = [{"cpus": 16, "memory": 8000, "gpus": 0}, {"cpus": 32, "memory": 64000, "gpus": 4}]
    request = {"nodes": "1", "ntasks-per-node": "1", "cpus-per-task": "1", "mem": "0", "gres": "none"}
    return submit.never_fits({**request, **flags}, "gpu", nodes)


def test_requests_that_no_node_can_hold_are_named():
    assert _never_fits(**{"cpus-per-task": "8"}) is None
    assert "pass --cpus-per-task=32 or fewer" in _never_fits(**{"cpus-per-task": "40"})
    assert "needs 32 cores on each of 2 node(s)" in _never_fits(nodes="2", **{"cpus-per-task": "32"})
    assert "at most 4 GPU(s) per node; pass --gpus-per-node=4" in _never_fits(gres="gpu:8")
    assert "nodes have at most 64000 MB" in _never_fits(mem="100G")
    assert "--nodes=3 but partition gpu has 2 node(s)" in _never_fits(nodes="3")


def test_a_pack_puts_points_of_a_sweep_side_by_side_on_one_node():
    """--pack 2: each job runs 2 points, each with the per-point counts given (--mem is a point's too)."""
    result = _dry_run(
        "--sweep", "--pack", "2", "--cpu", "--cpus-per-task", "1", "--mem", "1G", "--", "seed=1,2,3"
    )
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip())
    flags = _flags(command)
    assert (flags["nodes"], flags["ntasks-per-node"], flags["mem"], flags["array"]) == (
        "1",
        "2",
        "2G",
        "0-1",
    )
    assert command[-4:] == [str(ROOT / "slurm" / "pack.sbatch"), "--pack=2", "trainer=ddp_cpu", "seed=1,2,3"]


def test_a_pack_without_a_sweep_or_of_points_that_need_several_nodes_is_refused():
    alone = _dry_run("--pack", "2", "--", "seed=1,2")
    assert alone.returncode == 2
    assert (
        "error: --pack 2 runs several points of a sweep in one job, but this is not a sweep; add --sweep"
        in (alone.stderr)
    )
    wide = _dry_run("--sweep", "--pack", "2", "--nodes", "2", "--", "seed=1,2")
    assert wide.returncode == 2
    assert (
        "--nodes 2 asks for 2 nodes per point; pack points that fit one node (--nodes 1), or drop --pack"
        in (wide.stderr)
    )
    # Points that fit a node alone, but not all together: fewer to a job.
    nodes = [{"cpus": 16, "memory": 8000, "gpus": 0}, {"cpus": 32, "memory": 64000, "gpus": 4}]
    request = {"nodes": "1", "ntasks-per-node": "8", "cpus-per-task": "1", "mem": "0", "gres": "gpu:8"}
    assert _submit().pack_never_fits(4, request, "gpu", nodes) == (
        "--pack 4 puts 4 points of 2 GPU(s) each on one node, but partition gpu's nodes have at most 4; "
        "pass --pack 2 or fewer."
    )
    fits = {**request, "ntasks-per-node": "4", "gres": "gpu:4"}
    assert _submit().pack_never_fits(2, fits, "gpu", nodes) is None


def test_help_says_the_job_name_the_sbatch_files_give():
    """Without --job-name the job is named by the sbatch file (the project's name); --help says that
    name, not another."""
    import re

    helped = submit_in_process("--help")
    assert helped.returncode == 0, helped.stderr
    said = " ".join(helped.stdout.split())
    for name, option in (("train", ""), ("sweep", " with --sweep"), ("pack", " with --pack")):
        (given,) = re.findall(
            r"^#SBATCH --job-name=(\S+)", (ROOT / "slurm" / f"{name}.sbatch").read_text(), re.M
        )
        assert f"{given}{option}" in said, (given, said)
    assert "default: train)" not in said
    command = shlex.split(_dry_run("--nodes", "2", "--cpu", "--", "experiment=quickstart").stdout)
    assert "job-name" not in _flags(command)  # so sbatch takes the file's
