"""scripts/gpu_checks.py, the checks only a GPU node can run, as a tool that always finishes, loses
nothing and skips nothing silently: its form on this CPU machine (every GPU check a row "not run", the
exit status "partial"), its budget, and stand-in checks that pass, crash and hang, each in a process of
its own (the hang, and what it started, ended at its limit, every earlier result on disk while it ran).
The checks' own training runs need GPUs; what of them a CPU can show (the Slurm environment of one GPU
per task or of tasks sharing one, the callbacks they add to a run) is checked here too."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.helpers import PYTHON, ROOT, local_env

SCRIPT = ROOT / "scripts" / "gpu_checks.py"
# What issue 37 asks a GPU node to show: each item, the check that shows it
ITEMS = {
    "nccl hang names the rank (3)": "nccl_hang_named",
    "one GPU per task (4)": "one_gpu_per_task",
    "tensor-parallel counts (5)": "tensor_parallel",
    "CUDA wheel vs driver (7)": "cuda_driver",
    "bf16 support (8)": "bf16",
    "MFU on this GPU (8)": "mfu",
    "FSDP2 bf16, the character Transformer's text sample on (1)": "fsdp2",
}
# What issue 54 asks a GPU node to show: each item, the check that shows it
ISSUE_54 = {
    "lora_sft_gpu: bf16, activation checkpointing, generate with NCCL": "lora_sft_gpu",
    "cpu_offload in the order FSDP2 needs": "cpu_offload",
    "compile under FSDP2": "compile_fsdp2",
    "an uneven split": "uneven_split",
    "the side group with 2+ ranks": "side_groups",
    "sync_batchnorm applied under FSDP2": "sync_batchnorm",
}
# What a user with one GPU gets: each a check of the one-GPU set
ONE_GPU = {
    "NCCL at world size 1": "ddp_nccl",
    "FSDP2 at world size 1": "fsdp2",
    "async DCP": "async_dcp",
    "the watchdog (two tasks sharing the GPU)": "watchdog",
    "two tasks on one GPU over gloo (the launch logic)": "two_tasks_one_gpu",
    "a compute-bound Transformer's MFU, no profiler": "mfu",
    "host syncs per step, judged": "sync_points",
    "the flight recorder's dump read back": "flight_recorder",
}


@pytest.fixture(scope="module")
def tool() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("gpu_checks_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _stand_in(tool: ModuleType, name: str, code: str, gpus: int = 0, timeout_s: float = 60):
    """A check whose process runs `code` (its folder is sys.argv[1]) instead of one of the tool's."""

    @dataclass(frozen=True)
    class StandIn(tool.Check):
        code: str = ""

        def command(self, folder: Path, gpus: int) -> list[str]:
            return [PYTHON, "-c", self.code, str(folder)]

    return StandIn(name, gpus, timeout_s, None, code)


def _result(status: str, **details: object) -> str:
    """Code that leaves a check's result, as the tool's own checks do."""
    payload = json.dumps({"status": status, "summary": f"stand-in {status}", "details": details})
    return f"import sys, pathlib; pathlib.Path(sys.argv[1], 'result.json').write_text({payload!r})"


@pytest.mark.slow  # it waits for a hung check's timeout, 2 s
def test_a_crash_and_a_hang_are_rows_and_every_result_is_on_disk_as_it_comes(
    tool: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "out"
    hang = (
        "import os, shutil, subprocess, sys, time, pathlib; folder = pathlib.Path(sys.argv[1])\n"
        "shutil.copy(folder.parent / 'gpu_checks.json', folder / 'seen.json')\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "(folder / 'child.pid').write_text(str(child.pid)); time.sleep(300)"
    )
    monkeypatch.setattr(
        tool,
        "CHECKS",
        [
            _stand_in(tool, "environment", _result("passed", gpus=0, gpu_devices=0)),
            _stand_in(tool, "passes", _result("passed")),
            _stand_in(tool, "needs_a_gpu", "raise SystemExit('never run')", gpus=1),
            _stand_in(tool, "crashes", "raise SystemExit('something broke in the check')"),
            _stand_in(tool, "hangs", hang, timeout_s=2),
            _stand_in(tool, "after_the_hang", _result("passed")),
        ],
    )
    started = time.monotonic()
    assert tool.main(["--out", str(out)]) == 1  # a check failed
    assert time.monotonic() - started < 60

    report = json.loads((out / "gpu_checks.json").read_text())
    rows = {r["name"]: r for r in report["checks"]}
    assert report["finished"] is True and list(rows) == [c.name for c in tool.CHECKS]
    assert {n: r["status"] for n, r in rows.items()} == {
        "environment": "passed",
        "passes": "passed",
        "needs_a_gpu": "not run",
        "crashes": "failed",
        "hangs": "timed out",
        "after_the_hang": "passed",
    }
    assert rows["needs_a_gpu"]["summary"] == "no GPU here"
    assert rows["crashes"]["summary"] == "its process ended with exit status 1: something broke in the check"
    assert rows["hangs"]["summary"].startswith("timed out after 2 s")

    # while the hang ran, the results before it were on disk, and it was marked as running
    seen = json.loads((out / "hangs" / "seen.json").read_text())
    assert seen["finished"] is False
    assert [(r["name"], r["status"]) for r in seen["checks"]] == [
        ("environment", "passed"),
        ("passes", "passed"),
        ("needs_a_gpu", "not run"),
        ("crashes", "failed"),
        ("hangs", "running"),
    ]
    # what the hung check started ended with it (its own process group)
    child = int((out / "hangs" / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "zombie" in _state(child)

    printed = capsys.readouterr().out
    table = (out / "gpu_checks.txt").read_text()
    assert "hangs              timed out" in table and table.strip() in printed
    assert table.strip().endswith("3 passed, 1 not run, 1 failed, 1 timed out")
    assert "failed: crashes, hangs; not run: needs_a_gpu (no GPU here) (exit status 1)" in printed


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def test_a_bad_argument_is_one_sentence_and_exit_status_2(
    tool: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    assert tool.main(["--only", "nccl_hangs", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --only nccl_hangs is not a check; choose from environment, cuda_driver")
    assert error.count("\n") == 1
    assert tool.main(["--timeout", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --timeout 0 must be a number of seconds above 0.\n"
    assert tool.main(["--budget", "-5", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --budget -5 must be a number of seconds above 0.\n"
    assert not (tmp_path / "gpu_checks.json").exists()


def test_the_checks_cover_what_only_a_gpu_shows_of_issues_37_and_54(tool: ModuleType):
    """Each of issue 54's rows names, in the tool's own description, the figure it records and its pass
    line."""
    names = [c.name for c in tool.CHECKS]
    assert names[0] == "environment" and len(set(names)) == len(names)
    missing = {item: name for item, name in {**ITEMS, **ISSUE_54}.items() if name not in names}
    assert not missing
    described = tool.__doc__.split("Then what FSDP2 adds on GPUs", 1)[1]
    rows = {block.split()[0]: block for block in re.split(r"\n  (?=\w)", described)[1:]}
    for name in ISSUE_54.values():
        assert "Records" in rows[name] and "passes" in rows[name], name
    assert all(c.gpus >= 1 and c.timeout_s > 0 for c in tool.CHECKS[1:])


def test_one_gpu_runs_nccl_fsdp2_async_dcp_and_the_watchdog_first(tool: ModuleType):
    """A user's single GPU runs every check of the one-GPU set, which comes first (a budget that ends
    early cuts the multi-GPU checks), and the set's own limits fit the 8 minutes of --budget 480."""
    gpus = {c.name: c.gpus for c in tool.CHECKS}
    assert {item: gpus.get(name) for item, name in ONE_GPU.items()} == dict.fromkeys(ONE_GPU, 1)
    counts = [c.gpus for c in tool.CHECKS]
    assert counts == sorted(counts)


@pytest.mark.slow  # a check sleeps 1.8 s of its 3 s budget
def test_a_budget_that_runs_out_leaves_rows_that_say_so_and_a_partial_exit_status(
    tool: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setattr(tool, "LEAST_S", 1.5)  # sleepy starts with ~2.9 s left and leaves ~1 s
    sleepy = "import time; time.sleep(1.8); " + _result("passed")
    monkeypatch.setattr(
        tool,
        "CHECKS",
        [
            _stand_in(tool, "environment", _result("passed", gpus=1, gpu_devices=1, gpu_names=["H100"])),
            _stand_in(tool, "sleepy", sleepy),
            _stand_in(tool, "after", _result("passed")),
        ],
    )
    assert tool.main(["--out", str(tmp_path), "--budget", "3"]) == tool.PARTIAL == 3
    rows = {r["name"]: r for r in json.loads((tmp_path / "gpu_checks.json").read_text())["checks"]}
    assert rows["sleepy"]["status"] == "passed"
    assert (rows["after"]["status"], rows["after"]["summary"]) == (
        "not run",
        "the budget (--budget 3 s) was spent before it",
    )
    printed = capsys.readouterr().out
    assert "partial: every check that ran passed; could not run here: after (the budget" in printed
    (report,) = tmp_path.glob("*-gpu-checks.md")
    assert report.name == f"{time.strftime('%Y-%m-%d')}-gpu-checks.md"
    assert report.read_text().startswith(f"# GPU checks, {time.strftime('%Y-%m-%d')}: H100\n")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_one_gpu_per_task_check_starts_tasks_as_slurm_does(
    tool: ModuleType, monkeypatch: pytest.MonkeyPatch, rank: int
):
    """Its two processes get what `srun --ntasks-per-node=2 --gpus-per-task=1` gives: one GPU each, which
    the preflight accepts and Lightning's SLURM environment reads as two ranks of one node."""
    from lightning_fabric.plugins.environments import SLURMEnvironment

    from hpctrain.runtime.environment import allocated, launch_checks, launched

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # the allocation's GPUs, as the tool finds them
    env = tool.slurm_task_env(rank, 2, 29512)
    assert env["CUDA_VISIBLE_DEVICES"] == ["4", "5"][rank]
    assert launched.launcher(env) == launched.SLURM and allocated.one_gpu_per_task(env)
    launch_checks.preflight(1, 2, "gpu", env=env)  # trainer.devices=2: the tasks per node
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    slurm = SLURMEnvironment(auto_requeue=False)
    assert SLURMEnvironment.detect()
    assert (slurm.world_size(), slurm.global_rank(), slurm.local_rank(), slurm.node_rank()) == (
        2,
        rank,
        rank,
        0,
    )
    assert (slurm.main_address, slurm.main_port) == ("127.0.0.1", 29512)


def test_two_tasks_sharing_the_one_gpu_start_as_slurm_starts_them_and_only_gloo_may(
    tool: ModuleType, monkeypatch: pytest.MonkeyPatch
):
    """`--gres=gpu:1 --ntasks-per-node=2`: both tasks see the node's one GPU; the preflight lets them share
    it over gloo (the launch logic, the watchdog) and refuses it over NCCL ("Duplicate GPU")."""
    from hpctrain.runtime.environment import launch_checks, launched
    from hpctrain.runtime.errors import UserError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    envs = [tool.slurm_task_env(rank, 2, 29513, share_one_gpu=True) for rank in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "3"]
    assert [launched.global_rank(e) for e in envs] == [0, 1]
    for env in envs:
        launch_checks.preflight(1, 2, "gpu", env=env, backend="gloo")
        with pytest.raises(UserError, match="so ranks would share a GPU, which NCCL refuses"):
            launch_checks.preflight(1, 2, "gpu", env=env)


def test_the_launchers_variables_of_the_tools_own_shell_do_not_reach_its_runs(
    tool: ModuleType, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SRUN_CPUS_PER_TASK", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SLURM_TMPDIR", "/scratch/job")
    env = tool.clean_env()
    assert not {"SLURM_JOB_ID", "SLURM_NTASKS", "SRUN_CPUS_PER_TASK", "RANK"} & set(env)
    assert env["SLURM_TMPDIR"] == "/scratch/job"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "scripts")  # its runs' callbacks
    assert tool.slurm_task_env(0, 2, 1)["SLURM_JOB_ID"] == "42"  # scontrol knows the tool's own job


def test_the_callbacks_the_checks_add_to_a_run_compose_and_act_only_where_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    from pytorch_lightning import Callback

    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.config.targets import instantiate  # the configs' targets allowed (Hydra 1.4)

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as the tool's clean_env puts it on PYTHONPATH
    cfg = compose(
        "train",
        [
            "experiment=quickstart",
            "+callbacks.stall._target_=gpu_checks.StallRank",
            "+callbacks.stall.rank=1",
            "+callbacks.stall.at_step=3",
            "+callbacks.stall.seconds=600",
            "+callbacks.sync_window._target_=gpu_checks.SyncWindow",
            f"+callbacks.sync_window.out={tmp_path / 'places.json'}",
        ],
    )
    stall = instantiate(cfg.callbacks.stall)
    assert isinstance(stall, Callback) and isinstance(instantiate(cfg.callbacks.sync_window), Callback)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    for rank, step in [(0, 3), (1, 2), (1, 4), (1, 3)]:
        stall.on_before_backward(SimpleNamespace(global_rank=rank, global_step=step), None, None)
    assert slept == [600]


@pytest.mark.slow
def test_on_a_machine_without_a_gpu_it_says_what_it_could_not_run_and_exits_partial(tmp_path: Path):
    """`scripts/gpu_checks.py --budget 480` as a user runs it (and as a Slurm step runs it: the step's
    variables stay out of its runs): the environment check passes, every other check is a row saying it
    could not run here, and the exit status is "partial" (3), not "all ran" (0)."""
    env = {**local_env(), "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = tmp_path / "out"
    started = time.monotonic()
    result = subprocess.run(
        [PYTHON, "scripts/gpu_checks.py", "--budget", "480", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - started < 120
    report = json.loads((out / "gpu_checks.json").read_text())
    rows = {r["name"]: r for r in report["checks"]}
    assert report["finished"] and report["exit_status"] == 3 and set(ITEMS.values()) <= set(rows)
    assert rows.pop("environment")["status"] == "passed"
    assert {(r["status"], r["summary"]) for r in rows.values()} == {("not run", "no GPU here")}
    said = "partial: every check that ran passed; could not run here: cuda_driver (no GPU here); bf16 (no GPU"
    assert said in result.stdout and "(exit status 3)" in result.stdout
    assert (out / "gpu_checks.txt").read_text().strip() in result.stdout
    (dated,) = out.glob("*-gpu-checks.md")
    assert said in dated.read_text() and "driver none" in dated.read_text()


def test_the_fsdp2_rows_callbacks_record_what_their_pass_lines_read(
    tool: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """cpu_offload reads where the parameters and optimizer states live, side_groups sends SIGUSR1 on rank
    0 at one step, sync_batchnorm reads how far apart the ranks' BatchNorm statistics are."""
    import signal as signals

    import torch

    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    placed = tmp_path / "placed.json"
    trainer = SimpleNamespace(optimizers=[optimizer], is_global_zero=True, global_step=5)
    tool.WherePlaced(str(placed)).on_train_end(trainer, module)
    assert json.loads(placed.read_text()) == {"parameters": ["cpu"], "optimizer_states": ["cpu"]}

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    at = tool.SignalAt(step=5)
    for zero, step in [(False, 5), (True, 4), (True, 5)]:
        at.on_train_batch_end(SimpleNamespace(is_global_zero=zero, global_step=step), None, None, None, 0)
    assert sent == [(os.getpid(), signals.SIGUSR1)]

    spread = tmp_path / "spread.json"
    other = module[1].running_mean + torch.tensor([0.0, 0.5, 0.0, -0.25])  # another rank's statistics
    strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=lambda t: torch.stack([t, other]))
    trainer = SimpleNamespace(strategy=strategy, is_global_zero=True)
    tool.BatchNormSpread(str(spread)).on_train_end(trainer, module)
    assert json.loads(spread.read_text()) == {"largest": 0.5}


@pytest.mark.slow
@pytest.mark.ondemand
@pytest.mark.parametrize("check", ["uneven_split", "side_groups"])
def test_a_rehearsal_of_an_fsdp2_row_on_cpu_passes(
    tool: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, check: str
):
    """The row's own code, its runs under trainer=cpu and fsdp_cpu (gloo) instead of the GPU presets: what it
    shows is the plumbing (the overrides compose, the figures are read back, the pass line holds), never
    the GPU."""
    monkeypatch.setattr(
        tool, "TRAINER", {"gpu": "trainer=cpu", "ddp": "trainer=ddp_cpu", "fsdp": "trainer=fsdp_cpu"}
    )
    result = getattr(tool, check)(tmp_path, 2)
    assert result.status == "passed", result
