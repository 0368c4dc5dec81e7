"""Cluster presets (conf/cluster/): one place for a site's resources, read by scripts/submit.py --cluster
and by hydra/launcher=slurm with cluster=NAME; on the real two-node Slurm cluster, a preset's values
reach sbatch, the job array and the launcher's jobs (`scontrol show job` shows them)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.helpers import EXAMPLES, PYTHON, ROOT, submit_in_process

QUICK = ("experiment=quickstart", "trainer.max_epochs=1", "test=false", "extras.print_config=false")


def _flags(*args: str) -> dict[str, str]:
    result = submit_in_process("--dry-run", *args)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    return {a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in command if a.startswith("--") and "=" in a}


def test_the_local_preset_asks_for_the_job_the_test_suite_asks_for_by_hand():
    by_hand = _flags("--nodes", "2", "--cpu", "--cpus-per-task", "2", "--mem", "2G", "--", "x=1")
    preset = _flags("--cluster", "local", "--nodes", "2", "--", "x=1")
    # the same job, plus what the preset adds: the (default) partition and the time limit
    assert preset == {**by_hand, "partition": "debug", "time": "30"}


def test_flags_win_over_the_preset_and_gpu_types_reach_the_gres():
    flags = _flags("--cluster", "narval", "--nodes", "2", "--time", "60", "--", "x=1")
    assert (flags["gres"], flags["ntasks-per-node"], flags["cpus-per-task"]) == ("gpu:a100:4", "4", "12")
    assert (flags["mem"], flags["account"], flags["time"]) == ("496G", "def-yourpi", "60")


@pytest.mark.skipif(not EXAMPLES, reason="no datamodule that downloads without the examples")
def test_an_offline_preset_keeps_datamodules_from_downloading(tmp_path: Path):
    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.run import build

    base = ["data=mnist", f"paths.data_dir={tmp_path}", f"paths.output_dir={tmp_path}"]
    online = compose("train", base)
    assert build.datamodule(online.data, Settings.of(online)).download  # the data config's default
    offline = compose("train", [*base, "cluster=narval"])  # compute nodes without internet
    assert offline.cluster.offline and not build.datamodule(offline.data, Settings.of(offline)).download


@pytest.mark.slow
@pytest.mark.slurm
def test_a_presets_values_reach_sbatch_the_array_and_the_launcher(slurm_cluster, tmp_path: Path):
    def granted(job: str) -> dict[str, str]:
        info = slurm_cluster.job(job)
        return {k: info.get(k) for k in ("TimeLimit", "Partition", "NumCPUs", "MinMemoryNode")}

    submit = (
        PYTHON,
        "scripts/submit.py",
        "--cluster",
        "local",
        f"--sbatch-arg=--output={tmp_path}/%x-%j.out",
    )
    single = slurm_cluster.run(*submit, "--nodes", "2", "--", *QUICK, f"paths.log_dir={tmp_path}", cwd=ROOT)
    assert single.returncode == 0, single.stderr
    job = single.stdout.strip().split()[-1]
    array = slurm_cluster.run(
        *submit,
        "--sweep",
        "--nodes",
        "1",
        "--",
        *QUICK,
        "model.optimizer.lr=0.01,0.003",
        f"paths.log_dir={tmp_path}/a",
        cwd=ROOT,
    )
    assert array.returncode == 0, array.stderr
    array_job = array.stdout.strip().split()[-1]
    shown = granted(f"{array_job}_0")
    assert (shown["TimeLimit"], shown["Partition"]) == ("00:30:00", "debug"), shown
    slurm_cluster.run("scancel", array_job)  # what it was granted is all this test needs of it
    launched = slurm_cluster.run(
        PYTHON,
        "src/train.py",
        "-m",
        "hydra/launcher=slurm",
        "cluster=local",
        "trainer=ddp_cpu",
        "trainer.devices=1",
        *QUICK,
        "model.optimizer.lr=0.01",
        f"paths.log_dir={tmp_path}/l",
        cwd=ROOT,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    launcher_job = re.search(r"job 0: SLURM job (\S+)", launched.stdout + launched.stderr).group(1)
    for name in (job, launcher_job):
        shown = granted(name)
        assert (shown["TimeLimit"], shown["Partition"]) == ("00:30:00", "debug"), (name, shown)
    assert granted(launcher_job)["MinMemoryNode"] == "2G"  # mem_per_task_gb x 1 task
    info = slurm_cluster.wait(job, timeout_s=300)
    assert info["JobState"] == "COMPLETED"
    assert "cluster preset local: setup lines run" in next(tmp_path.glob(f"*-{job}.out")).read_text()
    (run,) = (tmp_path / "train" / "runs").iterdir()
    allocation = yaml.safe_load((run / "run.yaml").read_text())["attempts"][0]["slurm_allocation"]
    assert (allocation["partition"], allocation["cpus_per_task"], allocation["nodes"]) == ("debug", "2", "2")
    assert yaml.safe_load((run / "config.yaml").read_text())["cluster"]["name"] == "local"
    slurm_cluster.wait(f"{array_job}_1", timeout_s=300)
