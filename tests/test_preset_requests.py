"""A cluster preset asks Slurm for one job however it is submitted: scripts/submit.py (slurm/train.sbatch),
its job array (slurm/sweep.sbatch) and the SLURM launcher (hydra/launcher=slurm) give sbatch the same
resources for every shipped preset, for a site's own preset that leaves keys to the defaults, and for no
preset, where they are the `#SBATCH` lines of the sbatch files."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from hpctrain.runtime.config.compose import CONF_DIR, group_options
from hpctrain.runtime.config.settings import Cluster
from tests.helpers import PYTHON, ROOT, local_env

RESOURCES = (
    "nodes",
    "ntasks-per-node",
    "gres",
    "cpus-per-task",
    "mem",
    "time",
    "partition",
    "account",
    "qos",
)


def _minutes(time: str) -> int:
    """sbatch --time in minutes: `minutes` (the presets') or `hours:minutes:seconds` (the sbatch files')."""
    hours, minutes, _ = time.split(":") if ":" in time else ("0", time, "0")
    return int(hours) * 60 + int(minutes)


def _resources(flags: dict[str, str]) -> dict[str, object]:
    found: dict[str, object] = {flag: flags[flag] for flag in RESOURCES if flag in flags}
    found["time"] = _minutes(flags["time"])
    return found


def _submit(root: Path):
    spec = importlib.util.spec_from_file_location("submit", root / "scripts" / "submit.py")
    submit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(submit)
    return submit


def requests(name: str | None, root: Path = ROOT) -> dict[str, dict[str, object]]:
    """The resources sbatch is given for a 2-node job on the preset `name` (None: no preset): from
    scripts/submit.py's command and the batch file's #SBATCH lines under it, a single job and a job array,
    and from the SLURM launcher (the flags it writes into each job's batch file)."""
    preset = Cluster.load(group_options("cluster")[name]) if name else Cluster()
    cluster = ["--cluster", name] if name else []
    submit = _submit(root)
    asked = {
        "train.sbatch": submit.sbatch_command(submit.parse([*cluster, "--nodes", "2", "--", "seed=1"])),
        "sweep.sbatch": submit.sbatch_command(
            submit.parse([*cluster, "--nodes", "2", "--sweep", "--", "seed=1,2"])
        ),
    }
    found = {file: _resources(submit.requested(command)) for file, command in asked.items()}
    gpu = preset.gpus_per_node > 0
    overrides = [
        "hydra/launcher=slurm",
        *([f"cluster={name}"] if name else []),
        f"trainer={'ddp' if gpu else 'ddp_cpu'}",
        "trainer.num_nodes=2",
        f"trainer.devices={preset.gpus_per_node if gpu else preset.tasks_per_node}",
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides, return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)  # as Hydra makes it for a -m run
    launcher.config = cfg
    found["launcher"] = _resources(launcher.request())
    return found


@pytest.mark.parametrize("name", [*group_options("cluster"), None])
def test_submit_the_job_array_and_the_launcher_ask_for_the_same_resources(name: str | None):
    found = requests(name)
    assert found["train.sbatch"] == found["sweep.sbatch"] == found["launcher"], found
    preset = Cluster.load(group_options("cluster")[name]) if name else Cluster()
    assert found["launcher"]["time"] == preset.time_min and found["launcher"]["nodes"] == "2"
    assert found["launcher"]["cpus-per-task"] == str(preset.cpus_per_task)


def test_without_a_preset_the_sbatch_files_lines_are_the_defaults():
    """Plain `sbatch slurm/<file>` (no flags, no preset) asks for what a preset that sets nothing asks for."""
    submit = _submit(ROOT)
    one_node = ["--nodes", "1", "--", "seed=1"]
    defaults = _resources(submit.requested(submit.sbatch_command(submit.parse(one_node))))
    assert defaults == {
        "nodes": "1",
        "ntasks-per-node": str(Cluster().gpus_per_node),
        "gres": f"gpu:{Cluster().gpus_per_node}",
        "cpus-per-task": str(Cluster().cpus_per_task),
        "mem": "0",  # Cluster().mem_per_task_gb is 0: all of each node's memory
        "time": Cluster().time_min,
    }
    for file in ("train", "sweep", "pack"):
        lines = submit.file_defaults(ROOT / "slurm" / f"{file}.sbatch")
        assert _resources(lines) == defaults, (file, lines)


@pytest.mark.slow
def test_a_sites_own_preset_asks_for_the_same_resources_everywhere(tmp_path: Path):
    """A preset in the project's conf/cluster/ that leaves the CPUs, memory and time to the defaults."""
    project = tmp_path / "project"
    for part in ("conf", "scripts", "slurm"):
        shutil.copytree(ROOT / part, project / part, ignore=shutil.ignore_patterns("__pycache__", "local"))
    (project / "conf" / "cluster").mkdir()
    (project / "conf" / "cluster" / "site.yaml").write_text("name: site\npartition: gpu\ngpus_per_node: 4\n")
    code = (
        "import json; from pathlib import Path; from tests.test_preset_requests import requests; "
        f"print(json.dumps(requests('site', Path({str(project)!r}))))"
    )
    env = {**local_env(), "PYTHONPATH": str(ROOT), "HPCTRAIN_CODE_ROOT": str(project)}
    result = subprocess.run(
        [PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["train.sbatch"] == found["sweep.sbatch"] == found["launcher"], found
    defaults = Cluster()
    assert found["launcher"] == {
        "nodes": "2",
        "ntasks-per-node": "4",
        "gres": "gpu:4",
        "cpus-per-task": str(defaults.cpus_per_task),
        "mem": "0",
        "time": defaults.time_min,
        "partition": "gpu",
    }
