"""slurm/train.sbatch on a real two-node Slurm cluster (slurmctld + slurmd node1, node2 on this machine).

Nothing here mocks SLURM: jobs are submitted with sbatch, signalled with scancel, requeued by
scontrol, and their outputs read back.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import PYTHON, ROOT, last_value, metrics_without_timing, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

CPU_JOB = (
    "--nodes=2",
    "--ntasks-per-node=1",
    "--cpus-per-task=2",
    "--mem=2G",
    "--gres=none",
)  # README's CPU form
SBATCH_FILE = "slurm/train.sbatch"


def _submit(cluster, out_dir: Path, *args: str) -> str:
    return cluster.sbatch(f"--output={out_dir}/%x-%j.out", *args, cwd=ROOT)


def _output(out_dir: Path, job: str) -> str:
    files = list(out_dir.glob(f"*-{job}.out"))
    return files[0].read_text() if files else ""


def test_two_node_gloo_ddp_job_completes_with_every_logger_and_no_key_in_any_file(
    slurm_cluster, tmp_path: Path
):
    """The quickstart (8 of its 25 epochs) on two nodes, logging to every logger; the API keys the job was given are written
    to no file (the run dir's, the loggers', the job's output). Each rank's performance figures reach rank 0's
    loggers, summarised per node."""
    fake_key = "fake0123456789abcdef0123456789abcdef012345"
    # From the submitting shell's environment, as a user exports it (not on sbatch's command line:
    # --export=KEY=value is recorded in SLURM_EXPORT_ENV, which W&B saves with its SLURM metadata).
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        *CPU_JOB,
        SBATCH_FILE,
        "trainer=ddp_cpu",
        "experiment=quickstart",
        "trainer.max_epochs=8",  # past 0.9 test accuracy by then; the rest of the 25 proves nothing more here
        "trainer.log_every_n_steps=5",
        "debug=trace",  # a profiler trace per rank, each on its node
        "task_name=train",
        "logger=[many,mlflow,wandb]",  # csv + tensorboard, MLflow (a fresh SQLite store), W&B offline
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
        env={"WANDB_API_KEY": fake_key, "MLFLOW_TRACKING_TOKEN": fake_key},
    )
    info = slurm_cluster.wait(job, timeout_s=300)
    output = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", output[-4000:]
    assert "processes: 2 (process group backend: gloo)" in output
    runs = list((tmp_path / "train" / "runs").iterdir())
    assert [r.name for r in runs] == [f"slurm-{job}"]  # one run dir for both nodes, keyed by the job id
    run = runs[0]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert last_value(read_metrics(run), "test/acc") >= 0.9
    columns = set(read_metrics(run)[0])
    for rank, node in ((0, "node1"), (1, "node2")):  # rank 1 runs on the second node
        assert {f"ranks/step_ms/{rank}", f"ranks/data_wait/{rank}", f"nodes/{node}/step_ms_max"} <= columns
    ranks = yaml.safe_load((run / "outcome.yaml").read_text())["performance"]["ranks"]
    assert {r: v["host"] for r, v in ranks.items()} == {0: "node1", 1: "node2"}
    for rank in (0, 1):
        assert (
            json.loads((run / "traces" / f"rank{rank}.json").read_text())["distributedInfo"]["rank"] == rank
        )
    attempt = yaml.safe_load((run / "run.yaml").read_text())["attempts"][0]
    assert (attempt["launcher"], attempt["world_size"], attempt["slurm_job_id"]) == ("slurm", 2, job)

    assert (run / "mlflow.db").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*")) and list(
        (run / "wandb").glob("offline-run-*")
    )
    for path in tmp_path.rglob("*"):  # the run dir, and the job's SLURM output file
        if path.is_file():
            assert fake_key.encode() not in path.read_bytes(), path


PREFLIGHT_CASES = {
    "num_nodes": (
        (*CPU_JOB, SBATCH_FILE, "trainer=ddp_cpu", "trainer.num_nodes=1"),
        "error: trainer.num_nodes=1 but the SLURM job has 2 node(s) (--nodes=2); submit with --nodes=1 or pass trainer.num_nodes=2.",
    ),
    "devices": (
        (*CPU_JOB, SBATCH_FILE, "trainer=ddp_cpu", "trainer.devices=2"),
        "error: trainer.devices=2 but SLURM gives 1 task(s) per node (--ntasks-per-node=1); submit with --ntasks-per-node=2 or pass trainer.devices=1.",
    ),
    "no_srun": (
        (
            "--nodes=2",
            "--ntasks-per-node=1",
            f"--wrap={PYTHON} src/train.py trainer=ddp_cpu trainer.num_nodes=2 trainer.devices=1",
        ),
        "error: python runs in the sbatch script itself, not in an srun step",
    ),
    "ntasks_without_per_node": (
        ("--ntasks=2", f"--wrap=srun {PYTHON} src/train.py trainer=ddp_cpu"),
        "error: the SLURM job has 2 task(s) but no --ntasks-per-node",
    ),
    "scontrol_missing": (  # inside a container without the Slurm binaries (Apptainer, Pyxis): PATH has no scontrol
        (
            "--nodes=1",
            "--ntasks-per-node=1",
            f"--wrap=srun env PATH=/nonexistent {PYTHON} src/train.py trainer=cpu data=digits",
        ),
        "error: scontrol is not on PATH inside the job, so it cannot requeue itself when its time runs out",
    ),
    "gpus_not_matching_tasks": (
        ("--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--mem=1G", "--gres=none", SBATCH_FILE),
        "error: trainer.devices=4 (tasks per node) but this process sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1)",
    ),
}


@pytest.mark.parametrize("workers", range(1, 9))
def test_the_workers_clusters_give_no_two_jobs_one_master_port(workers: int):
    """Each pytest-xdist worker's cluster numbers its jobs from its own first id: over the ids each submits
    (up to its share), the MASTER_PORTs slurm/job_env.sh derives (15000 + id % 15000) never meet."""
    from hpctrain.testing.plugin import PORTS, first_job_id

    firsts = [first_job_id(f"gw{i}", workers) for i in range(workers)]
    share = min(b - a for a, b in zip(firsts, [*firsts[1:], firsts[0] + PORTS], strict=True))
    assert share >= 1000  # a session's jobs per worker: a few hundred
    ports = [{15000 + (first + k) % PORTS for k in range(share)} for first in firsts]
    assert sum(map(len, ports)) == len(set().union(*ports)) == share * workers


def test_a_cluster_started_on_the_ports_of_another_refuses_and_leaves_it_alone(
    slurm_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Two clusters started at once on one machine pick their ports in turn; one that still finds its
    ports taken (by a daemon outside the suite) says so, instead of sending its jobs to the other."""
    from hpctrain.testing import local_slurm

    conf = slurm_cluster.conf.read_text()
    first_node, last_node = map(int, re.search(r" Port=\[(\d+)-(\d+)\]", conf).groups())
    taken = [
        int(re.search(r"^SlurmctldPort=(\d+)$", conf, re.MULTILINE)[1]),
        *range(first_node, last_node + 1),
    ]
    monkeypatch.setattr(local_slurm, "_free_ports", lambda count: taken[:count])
    other = local_slurm.LocalSlurmCluster(tmp_path / "other", first_job_id=slurm_cluster.first_job_id + 500)
    with pytest.raises(local_slurm.ClusterUnavailable, match="another Slurm controller answers on this"):
        other.start(timeout_s=20)
    job = slurm_cluster.sbatch(f"--output={tmp_path}/%j.out", "--wrap=true", cwd=tmp_path)
    assert slurm_cluster.wait(job, timeout_s=60)["JobState"] == "COMPLETED"


@pytest.mark.parametrize("case", PREFLIGHT_CASES)
def test_preflight_mismatch_fails_fast_with_one_sentence(slurm_cluster, tmp_path: Path, case: str):
    args, sentence = PREFLIGHT_CASES[case]
    started = time.monotonic()
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        *args,
        f"paths.log_dir={tmp_path}" if SBATCH_FILE in args else "--job-name=bare",
        cwd=ROOT,
        env={"CUDA_VISIBLE_DEVICES": "0,1"} if case == "gpus_not_matching_tasks" else None,
    )
    assert int(job) >= slurm_cluster.first_job_id  # this worker's ids: a MASTER_PORT of its own
    info = slurm_cluster.wait(job, timeout_s=120)  # a hang would time out here
    output = _output(tmp_path, job)
    assert info["JobState"] == "FAILED", output[-3000:]
    assert sentence in output, output[-3000:]
    assert "Traceback" not in output and "Initializing distributed" not in output  # before any process group
    assert time.monotonic() - started < 60


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def test_time_limit_signal_requeues_and_resumes_exactly(slurm_cluster, tmp_path: Path, digit_shards: Path):
    """USR1 mid-epoch -> checkpoint -> scontrol requeue -> the restarted job finishes with the same
    weights and metrics as an uninterrupted job (CPU, same seed, dropout included).

    The data are shards (scripts/make_shards.py) staged per node (each node's own stage dir) and read by
    a loader worker per rank; the requeued attempt reuses its node's copy.
    Both jobs fine-tune (init_from.path): the requeued attempt continues from its own requeue.ckpt and
    leaves init_from alone; re-applied, it would put the start weights back under the trained ones and
    the final weights would differ from the uninterrupted job's.
    The interrupted job is submitted by scripts/submit.py from a copy of the project whose code is then
    edited so that it fails: both attempts run the code as submitted (submit.py's snapshot)."""
    from tests.helpers import train

    start = train(tmp_path / "start", "data=digits", "trainer=cpu", "trainer.max_epochs=1", "test=false")
    assert start.returncode == 0, start.stdout[-3000:]
    (weights,) = (tmp_path / "start").rglob("last.ckpt")
    overrides = (
        f"init_from.path={weights}",
        "trainer=ddp_cpu",
        "data=shards",  # the digits datamodule's splits, as image files made into shards
        f"data.root={digit_shards}",
        "data.num_classes=10",
        "data.image_shape=[1,28,28]",
        "data.mean=[0.1310]",
        "data.std=[0.2920]",
        "data.num_workers=1",
        f"data.stage_dir={tmp_path}/scratch/${{oc.env:SLURM_JOB_ID}}/${{oc.env:SLURMD_NODENAME}}",
        "data.batch_size=16",
        "trainer.max_epochs=2",
        "callbacks.progress.log_every_n_s=0",
        "trainer.log_every_n_steps=1",  # every step's loss is compared, and every step is a logging step
        "logger=[csv,mlflow,wandb]",  # the requeued job must continue the same MLflow and W&B runs
        # 0.15 s per step, or on a quiet machine the second epoch ends before the signal arrives
        "+callbacks.slow._target_=tests.differential.user_code.SlowRankCallback",
        f"paths.log_dir={tmp_path}",
        "extras.print_config=false",
    )
    slow = {"PYTHONPATH": str(ROOT), "SLOW_RANK": "0", "SLOW_S": "0.15"}
    # The interrupted job goes through scripts/submit.py, the reference job through plain sbatch.
    project = _project_copy(tmp_path / "project")
    submitted = slurm_cluster.run(
        PYTHON,
        "scripts/submit.py",
        "--nodes",
        "2",
        "--cpu",
        f"--sbatch-arg=--output={tmp_path}/%x-%j.out",
        "--",
        *overrides,
        cwd=project,
        # Submitted from a shell whose wandb service (a notebook's, on the login node) the job cannot
        # reach: the job must start its own (slurm/site.sh), or wandb.init fails on the compute node.
        env={**slow, "WANDB_SERVICE": "3-1-unix-/nonexistent/login-node-wandb.sock"},
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "code snapshot: " in submitted.stdout
    interrupted = submitted.stdout.strip().split()[-1]
    reference = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out", *CPU_JOB, SBATCH_FILE, *overrides, cwd=ROOT, env=slow
    )
    (snapshot,) = (project / "logs" / "snapshots").iterdir()
    _break_the_training_step(project)

    # Signal as the time limit would, once the job is well into its second epoch.
    deadline = time.monotonic() + 240
    while "epoch 1/2  step 10/" not in _output(tmp_path, interrupted):
        assert time.monotonic() < deadline, _output(tmp_path, interrupted)[-3000:]
        time.sleep(0.2)
    staged = {
        node: tmp_path
        / "scratch"
        / interrupted
        / node
        / f"hpctrain-{getpass.getuser()}"
        / digit_shards.name
        / ".staged.json"
        for node in ("node1", "node2")
    }
    assert all(marker.is_file() for marker in staged.values()), list((tmp_path / "scratch").rglob("*"))
    made = {node: marker.stat().st_mtime_ns for node, marker in staged.items()}
    assert slurm_cluster.run("scancel", "--signal=USR1", interrupted).returncode == 0
    # The requeued job starts again once the nodes' credential for it expires (10 s on the test cluster).
    deadline = time.monotonic() + 180
    while True:
        info = slurm_cluster.job(interrupted)
        if info.get("Restarts") == "1" and info.get("JobState") in ("RUNNING", "COMPLETED"):
            break  # running again (or done)
        state = {k: info.get(k) for k in ("JobState", "Reason", "Restarts", "StartTime")}
        assert time.monotonic() < deadline, (state, _output(tmp_path, interrupted)[-2000:])
        assert info.get("JobState") != "FAILED", (state, _output(tmp_path, interrupted)[-2000:])
        time.sleep(1)

    for job in (interrupted, reference):
        info = slurm_cluster.wait(job, timeout_s=400)
        assert info["JobState"] == "COMPLETED", _output(tmp_path, job)[-4000:]
    runs = tmp_path / "train" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == sorted([f"slurm-{interrupted}", f"slurm-{reference}"])
    resumed, uninterrupted = runs / f"slurm-{interrupted}", runs / f"slurm-{reference}"

    log = _output(tmp_path, interrupted)
    requeue_ckpt = resumed / "checkpoints" / "requeue.ckpt"
    assert (
        f"requeued SLURM job {interrupted}" in log
        and f"starting from {requeue_ckpt} (restart 1 of this job)" in log
    )
    assert "starting fresh" in _output(tmp_path, reference)  # a new job never loads another's checkpoint
    assert f"init_from.path={weights} skipped: the run continues from {requeue_ckpt}" in log
    assert log.count("init_from: loaded") == 1 and "init_from: loaded" in _output(tmp_path, reference)

    # The checkpoint was taken mid-epoch, and the resumed run continued from there in the same run dir.
    loops = torch.load(requeue_ckpt, map_location="cpu", weights_only=True)["loops"]["fit_loop"]
    done_in_epoch = loops["epoch_loop.batch_progress"]["current"]["processed"]
    assert 0 < done_in_epoch < 40, done_in_epoch  # 629 digits / 16 per batch per rank = 40 batches
    record = yaml.safe_load((resumed / "run.yaml").read_text())
    assert [a["slurm_restart_count"] for a in record["attempts"]] == [0, 1]
    # Its cost counts both attempts; the first saved requeue.ckpt as it ended, so nothing was redone.
    cost = yaml.safe_load((resumed / "outcome.yaml").read_text())["cost"]
    assert [(a["ended"], a["processes"]) for a in cost["attempts"]] == [("requeued", 2), ("completed", 2)]
    assert cost["attempts"][0]["redone_hours"] == 0 and cost["total"]["attempts"] == 2
    assert cost["total"]["device_hours"] == pytest.approx(sum(a["device_hours"] for a in cost["attempts"]))
    # Both attempts ran the code as submitted, not the project's code edited since.
    assert record["git"]["snapshot"] == str(snapshot) and "edited after submission" not in log

    # Exact resume: identical final weights and identical metrics, every epoch.
    final, expected = (
        _state_dict(resumed / "checkpoints" / "last.ckpt"),
        _state_dict(uninterrupted / "checkpoints" / "last.ckpt"),
    )
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final), [
        k for k in final if not torch.equal(final[k], expected[k])
    ]
    assert metrics_without_timing(resumed) == metrics_without_timing(uninterrupted)

    # The loggers continued their runs: one MLflow run holding every step of both attempts, one W&B id.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{resumed}/mlflow.db")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")]
    assert len(steps) == len(set(steps)) == 2 * 40  # every step of both attempts, once
    wandb_runs = list((resumed / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and len({r.name.rsplit("-", 1)[-1] for r in wandb_runs}) == 1

    # Each job's rank 0 listened on a port of its own, derived from its job id (slurm/job_env.sh), in
    # both attempts: nothing bound and released first, which another process could have taken.
    ports = {
        job: set(re.findall(r"rank 0 at \S+:(\d+)", _output(tmp_path, job)))
        for job in (interrupted, reference)
    }
    assert ports == {job: {str(15000 + int(job) % 15000)} for job in (interrupted, reference)}
    # Each node staged its own copy once; the requeued attempt read the copy its node already had.
    assert {node: marker.stat().st_mtime_ns for node, marker in staged.items()} == made


def test_node_local_log_dir_fails_fast(slurm_cluster, tmp_path: Path):
    """A run dir that differs per node (node-local scratch) would scatter checkpoints: refuse it."""
    node_local = f"paths.log_dir={tmp_path}/${{oc.env:SLURMD_NODENAME}}"
    job = _submit(
        slurm_cluster, tmp_path, *CPU_JOB, SBATCH_FILE, "trainer=ddp_cpu", "data=digits", node_local
    )
    info = slurm_cluster.wait(job, timeout_s=180)
    output = _output(tmp_path, job)
    assert info["JobState"] == "FAILED", output[-3000:]
    assert (
        f"error: rank 1 on {socket.gethostname()} uses the run dir {tmp_path}/node2/train/runs/slurm-{job}"
        in output
    )
    assert "Traceback" not in output and "Epoch 0" not in output


def test_srun_torchrun_with_one_task_per_node_trains_one_model(slurm_cluster, tmp_path: Path):
    """the SLURM guide's `srun torchrun` form, exactly as `scripts/torchrun_command.py --srun` prints it,
    as a batch script: one task per node, each a torchrun agent; one run dir named after the job."""
    printed = slurm_cluster.run(
        PYTHON,
        "scripts/torchrun_command.py",
        "--nodes=2",
        "--cpu",
        "--processes-per-node=1",
        "--srun",
        "--",
        "data=digits",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=10",
        "callbacks.progress.log_every_n_s=0",
        "extras.print_config=false",
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
    )
    assert printed.returncode == 0, printed.stderr
    lines = [line for line in printed.stdout.splitlines() if line and not line.startswith("#")]
    script = tmp_path / "torchrun.sbatch"
    script.write_text("#!/bin/bash\nsource slurm/site.sh\n" + "\n".join(lines) + "\n")
    job = _submit(slurm_cluster, tmp_path, *CPU_JOB, "--job-name=torchrun", str(script))
    info = slurm_cluster.wait(job, timeout_s=300)
    output = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", output[-4000:]
    runs = tmp_path / "train" / "runs"
    assert [p.name for p in runs.iterdir()] == [f"torchrun-{job}"]  # both nodes' ranks in one run dir
    record = yaml.safe_load((runs / f"torchrun-{job}" / "run.yaml").read_text())
    (attempt,) = record["attempts"]
    assert attempt["launcher"] == "torchrun" and attempt["world_size"] == 2, attempt
    assert 0 <= last_value(read_metrics(runs / f"torchrun-{job}"), "test/acc") <= 1


def test_a_signal_during_prediction_requeues_the_job_which_predicts_everything_again(
    slurm_cluster, tmp_path: Path
):
    """ENTRY=src/predict.py through slurm/train.sbatch on two nodes: USR1 mid-prediction -> scontrol
    requeue -> the restarted job predicts again and writes the whole output once, in input order."""
    from tests.differential.cases import user_code, user_overrides
    from tests.differential.user_code import PredictingClassifier, _digits
    from tests.helpers import run_entry

    user = {"PYTHONPATH": str(ROOT)}
    trained = run_entry(
        "train.py",
        *user_overrides("PredictingClassifier", data="PredictData"),
        "trainer=cpu",
        "trainer.max_epochs=1",
        f"hydra.run.dir={tmp_path}/trained",
        env=user,
    )
    assert trained.returncode == 0, trained.stdout[-3000:]
    checkpoint = tmp_path / "trained" / "checkpoints" / "last.ckpt"
    output = tmp_path / "predictions.pt"
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        *CPU_JOB,
        SBATCH_FILE,
        "trainer=ddp_cpu",
        f"ckpt_path={checkpoint}",
        *user_code("PredictingClassifier", data="PredictData"),  # its classes, named as at training
        "+data.batch_size=4",  # 81 samples per rank: 21 batches, checked for a signal every 10
        f"predict.output={output}",
        f"paths.log_dir={tmp_path}",
        cwd=ROOT,
        env={**user, "ENTRY": "src/predict.py", "SLOW_PREDICT": "0.3"},
    )
    deadline = time.monotonic() + 180
    while "predict batch 3" not in _output(tmp_path, job):
        assert time.monotonic() < deadline, _output(tmp_path, job)[-3000:]
        assert slurm_cluster.job(job).get("JobState") != "FAILED", _output(tmp_path, job)[-3000:]
        time.sleep(0.2)
    assert slurm_cluster.run("scancel", "--signal=USR1", job).returncode == 0
    info = slurm_cluster.wait(job, timeout_s=300)
    log = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", log[-4000:]
    assert f"requeued SLURM job {job} (SIGUSR1 during prediction)" in log, log[-4000:]

    predictions = torch.load(output, weights_only=True)
    assert predictions["index"].tolist() == list(range(161))  # every sample once, in input order
    module = PredictingClassifier()
    module.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    with torch.no_grad():
        expected = module.eval()(_digits(161)[0]).softmax(dim=-1)
    torch.testing.assert_close(predictions["predictions"], expected, rtol=1e-4, atol=1e-5)
    assert not list(tmp_path.rglob("part-rank*.pt")) and not list(tmp_path.glob(".predictions.pt.tmp-*"))


def _break_the_training_step(project: Path) -> None:
    """Edit the project's model so that a training step fails, as an edit after submission might."""
    model = project / "src" / "myproject" / "models" / "classifier.py"
    edited = model.read_text().replace(
        "        loss, preds, y = self._loss_and_predictions(batch)\n        self.train_acc.update(preds, y)",
        '        raise RuntimeError("the code edited after submission ran")',
        1,
    )
    assert edited != model.read_text()
    model.write_text(edited)


def _project_copy(target: Path) -> Path:
    """A copy of this project's code as a git working copy of its own (the project's venv linked in)."""
    import shutil
    import subprocess

    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    (target / ".venv").symlink_to(ROOT / ".venv")
    git = ["git", "-C", str(target), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the code as submitted"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    return target


def test_a_sharded_job_signalled_mid_epoch_requeues_and_ends_as_the_uninterrupted_one(
    slurm_cluster, tmp_path: Path
):
    """FSDP2 over two nodes (trainer=fsdp_cpu, one rank per node): USR1 mid-epoch -> a sharded requeue.ckpt
    folder -> requeue -> the restarted job ends with the uninterrupted job's weights and metrics."""
    from hpctrain.runtime.storage.checkpoints.sharded import read_folder

    overrides = (
        "experiment=quickstart",
        "trainer=fsdp_cpu",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        "callbacks.progress.log_every_n_s=0",
        "+callbacks.slow._target_=tests.differential.user_code.SlowRankCallback",
        f"paths.log_dir={tmp_path}",
        "extras.print_config=false",
    )
    slow = {"PYTHONPATH": str(ROOT), "SLOW_RANK": "0", "SLOW_S": "0.3"}
    submit = (f"--output={tmp_path}/%x-%j.out", *CPU_JOB, SBATCH_FILE, *overrides)
    interrupted = slurm_cluster.sbatch(*submit, cwd=ROOT, env=slow)
    reference = slurm_cluster.sbatch(*submit, cwd=ROOT, env=slow)
    deadline = time.monotonic() + 240
    while "epoch 1/2  step 3/" not in _output(tmp_path, interrupted):
        assert time.monotonic() < deadline, _output(tmp_path, interrupted)[-3000:]
        time.sleep(0.2)
    assert slurm_cluster.run("scancel", "--signal=USR1", interrupted).returncode == 0
    for job in (interrupted, reference):
        info = slurm_cluster.wait(job, timeout_s=400)
        assert info["JobState"] == "COMPLETED", _output(tmp_path, job)[-4000:]
    runs = tmp_path / "train" / "runs"
    resumed, uninterrupted = runs / f"slurm-{interrupted}", runs / f"slurm-{reference}"
    requeue_ckpt = resumed / "checkpoints" / "requeue.ckpt"
    log = _output(tmp_path, interrupted)
    assert f"starting from {requeue_ckpt} (restart 1 of this job)" in log
    assert (requeue_ckpt / ".metadata").is_file() and len(list(requeue_ckpt.glob("*.distcp"))) == 2
    final, expected = (
        read_folder(r / "checkpoints" / "last.ckpt")["state_dict"] for r in (resumed, uninterrupted)
    )
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final), [
        k for k in final if not torch.equal(final[k], expected[k])
    ]
    assert metrics_without_timing(resumed) == metrics_without_timing(uninterrupted)


def test_a_time_limit_signal_during_the_teardown_of_a_completed_job_leaves_it_completed(
    slurm_cluster, tmp_path: Path
):
    """The last attempt of a job its time limit sliced finishes fit and test; SLURM's USR1 then comes while
    rank 0's process finalizes (destructors that take seconds, after CPython stopped running Python
    signal handlers and gave them back their default action, which kills). The job did all its work: it
    stays COMPLETED (an `afterok` dependency starts, an array counts it done), not FAILED."""
    mark = tmp_path / "finalizing"
    job = _submit(
        slurm_cluster,
        tmp_path,
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--mem=2G",
        "--gres=none",
        "--export=ALL,PYTHONPATH=" + str(ROOT) + f",SLOW_TEARDOWN_MARK={mark},SLOW_TEARDOWN_S=8",
        SBATCH_FILE,
        "trainer=cpu",
        "data=digits",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=5",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "callbacks.progress.log_every_n_s=0",
        "extras.print_config=false",
        f"paths.log_dir={tmp_path}",
        "+callbacks.slow_teardown._target_=tests.job_callbacks.SlowTeardown",
    )
    deadline = time.monotonic() + 240
    while not mark.exists():
        state = slurm_cluster.job(job).get("JobState")
        assert time.monotonic() < deadline and state not in ("COMPLETED", "FAILED"), (
            state,
            _output(tmp_path, job)[-3000:],
        )
        time.sleep(0.2)
    assert slurm_cluster.run("scancel", "--signal=USR1", job).returncode == 0
    info = slurm_cluster.wait(job, timeout_s=120)
    output = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-3000:])
    assert "User defined signal" not in output and "run dir: " in output
