"""Packed jobs without a cluster: how a pack's allocation is shared, which points an array task runs, and
the driver (hpctrain.runtime.sweeps.pack) over points that complete, fail, die or save for the requeue, in
two attempts of one job. The real thing, signalled and requeued: tests/test_slurm_sweeps.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from hpctrain.runtime.environment import launched, pack_shares, slurm_job
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.sweeps import pack

JOB = {
    "SLURM_JOB_ID": "7",
    "SLURM_ARRAY_JOB_ID": "7",
    "SLURM_ARRAY_TASK_ID": "0",
    "SLURM_ARRAY_TASK_COUNT": "1",
    "SLURM_ARRAY_TASK_MIN": "0",
    "SLURM_ARRAY_TASK_MAX": "0",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_CPUS_PER_TASK": "2",
    "SLURM_MEM_PER_NODE": "8000",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_each_point_gets_an_even_share_of_the_node():
    share = pack_shares.pack_share(4, JOB)
    assert (share.tasks, share.cpus_per_task, share.memory_mb, share.gpus) == (2, 2, 2000, 2)
    step = pack_shares.pack_step_env(share, 3, "/logs/x.point3.out", {**JOB, "MASTER_PORT": "1234"})
    assert {k: step[k] for k in ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SRUN_CPUS_PER_TASK")} == {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SRUN_CPUS_PER_TASK": "2",
    }
    assert (step["SLURM_EXACT"], step["SLURM_MEM_PER_NODE"], step["SLURM_STEP_GRES"]) == (
        "1",
        "2000",
        "gpu:2",
    )
    assert "MASTER_PORT" not in step  # each point's rank 0 finds a port of its own
    assert launched.pack_point(step) == 3 and slurm_job.slurm_output_file(step) == "/logs/x.point3.out"
    assert launched.run_id({**step, "SLURM_STEP_ID": "5"}) == "slurm-7_0-point3"  # the same in every attempt

    with pytest.raises(
        UserError, match=r"but the job has 8 task\(s\) on it \(--ntasks-per-node=8\), which 3 "
    ):
        pack_shares.pack_share(3, JOB)
    with pytest.raises(UserError, match="but this job has 2 nodes; submit it with --nodes=1"):
        pack_shares.pack_share(2, {**JOB, "SLURM_JOB_NUM_NODES": "2"})


def test_an_array_task_runs_its_pack_of_the_grid(monkeypatch):
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert pack.points_of_this_task(5, 2, None) == [4]
    assert pack.points_of_this_task(9, 2, [1, 3, 5, 7, 8]) == [8]
    with pytest.raises(UserError, match=r"5 point\(s\), 1 to a job, make 5 job\(s\), .* --array=0-4"):
        pack.points_of_this_task(5, 1, None)
    with pytest.raises(UserError, match=r"--points names job 9, but the sweep grid has 9 point\(s\)"):
        pack.points_of_this_task(9, 2, [1, 9])


# slurm/train.sbatch for the driver's test: seed=1 completes, seed=2 fails, seed=3 saves for the requeue in
# the first attempt and completes in the second, seed=4 dies without a word.
FAKE_POINT = """#!/bin/bash
for arg; do case "$arg" in hydra.run.dir=*) run="${arg#*=}" ;; seed=*) seed="${arg#*=}" ;; esac; done
echo "$HPCTRAIN_PACK_POINT ${SLURM_RESTART_COUNT:-0} $SLURM_NTASKS_PER_NODE $SRUN_CPUS_PER_TASK $SLURM_MEM_PER_NODE" >> "$CALLS"
mkdir -p "$run"
now="$(date '+%Y-%m-%d %H:%M:%S')"
printf 'attempts:\\n- started: "%s"\\n  slurm_job_id: "7_0"\\n' "$now" > "$run/run.yaml"
outcome() { printf 'status: %s\\nerror: "%s"\\nfinished: "%s"\\n' "$1" "$2" "$now" > "$run/outcome.yaml"; }
case "$seed" in
    1) outcome completed "" ;;
    2) outcome failed "ValueError: boom"; exit 1 ;;
    3) if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then outcome requeued "SIGUSR1 during training"; else outcome completed ""; fi ;;
    4) kill -9 $$ ;;
esac
"""


@pytest.mark.slow  # real driver processes: out of the quick tier's 30 s
def test_the_driver_lets_points_end_apart_and_requeues_the_job_once(tmp_path, monkeypatch, capsys):
    code, tools, sweep = tmp_path / "code", tmp_path / "bin", tmp_path / "sweep"
    (code / "slurm").mkdir(parents=True)
    (code / "slurm" / "train.sbatch").write_text(FAKE_POINT)
    tools.mkdir()
    (tools / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol\n')
    (tools / "scontrol").chmod(0o755)
    for key, value in {**JOB, "SLURM_NTASKS_PER_NODE": "4", "SLURM_MEM_PER_NODE": "4000"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    monkeypatch.setenv("HPCTRAIN_SWEEP_DIR", str(sweep))  # where the points go, without composing a config
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("PATH", f"{tools}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.chdir(code)
    monkeypatch.setattr(pack, "REQUEUE_WAIT_S", 0)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    try:
        assert pack.main(["--pack=4", "seed=1,2,3,4"]) == 1
        first = capsys.readouterr().out
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        assert pack.main(["--pack=4", "seed=1,2,3,4"]) == 1
        second = capsys.readouterr().out
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    # Attempt 1: every point in its own step with a quarter of the node; one requeue, after all ended.
    assert "each 1 task(s) x 2 CPU(s), 1000 MB" in first
    assert "point 0 ended: completed" in first and "point 1 ended: failed (ValueError: boom)" in first
    assert "point 2 ended: requeued (SIGUSR1 during training)" in first
    assert (
        "point 3 ended: failed (its step ended (killed by SIGKILL) without a record of how it ended" in first
    )
    assert "requeued SLURM job 7_0 once its points had saved or ended; point(s) 2 run again" in first
    assert (tmp_path / "scontrol").read_text().count("requeue 7_0") == 1
    lost = yaml.safe_load((sweep / "3" / "outcome.yaml").read_text())
    assert lost["status"] == "failed" and "killed by SIGKILL" in lost["error"]
    # Attempt 2: only the point that saved for the requeue runs again.
    for number, how in ((0, "completed"), (1, "failed"), (3, "failed")):
        assert f"point {number} {how} in an earlier attempt of this job: not run again" in second
    assert "point 2 ended: completed" in second
    assert "2 of 4 point(s) completed; point 1 failed; point 3 failed" in second
    calls = [line.split() for line in (tmp_path / "calls").read_text().splitlines()]
    assert sorted(calls) == sorted(
        [[n, "0", "1", "2", "1000"] for n in "0123"] + [["2", "1", "1", "2", "1000"]]
    )


@pytest.mark.slow  # real driver processes: out of the quick tier's 30 s
def test_the_driver_runs_the_jobs_a_launcher_listed(tmp_path, monkeypatch, capsys):
    """--jobs=<file>: the SLURM launcher's jobs (hydra.launcher.pack=N), any job numbers and overrides (an
    Optuna batch is no grid), into the sweep dir the file names."""
    code, sweep = tmp_path / "code", tmp_path / "sweep"
    (code / "slurm").mkdir(parents=True)
    (code / "slurm" / "train.sbatch").write_text(FAKE_POINT)
    for key, value in {**JOB, "SLURM_NTASKS_PER_NODE": "2", "SLURM_MEM_PER_NODE": "4000"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    monkeypatch.chdir(code)
    jobs = pack.write_jobs(sweep, [(4, ["lr=0.3", "seed=1"]), (5, ["lr=0.01", "seed=2", "x=1"])], 4)
    assert jobs == sweep / ".pack" / "jobs-4.yaml"
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    try:
        assert pack.main(["--pack=2", f"--jobs={jobs}"]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out = capsys.readouterr().out
    assert "points 4, 5 of the 2 in jobs-4.yaml, side by side, each 1 task(s) x 2 CPU(s), 2000 MB" in out
    assert "point 4 (lr=0.3 seed=1): output in" in out and "point 5 (lr=0.01 seed=2 x=1)" in out
    assert "point 4 ended: completed" in out and "point 5 ended: failed (ValueError: boom)" in out
    assert "1 of 2 point(s) completed; point 5 failed" in out
    assert yaml.safe_load((sweep / "4" / "outcome.yaml").read_text())["status"] == "completed"
    calls = sorted(line.split()[0] for line in (tmp_path / "calls").read_text().splitlines())
    assert calls == ["4", "5"]  # HPCTRAIN_PACK_POINT: the job number, as the run dir's name

    with pytest.raises(UserError, match="pass either --jobs=<file> or --points and a sweep grid"):
        pack.parse(["--pack=2", f"--jobs={jobs}", "seed=1,2"])
    (sweep / ".pack" / "bad.yaml").write_text("jobs: 3\n")
    with pytest.raises(UserError, match=r"is not a file of jobs the SLURM launcher wrote \(TypeError"):
        pack.read_jobs(sweep / ".pack" / "bad.yaml")
