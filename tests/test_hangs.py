"""A hung or slow job explains itself (real processes, DDP on CPU): stacks on demand, a rank that does
not arrive at a collective named, stragglers named."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.differential.cases import user_overrides
from tests.helpers import PYTHON, ROOT, local_env, run_dirs, train


def _start(run_dir: Path, *overrides: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            PYTHON,
            "src/train.py",
            *user_overrides("SleepyRank"),
            "trainer=ddp_cpu",
            "trainer.devices=2",
            "trainer.max_epochs=1",
            "extras.print_config=false",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        cwd=ROOT,
        env={**local_env(), "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(path: Path, process: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _line_of(text: str) -> int:
    source = (ROOT / "tests" / "differential" / "user_code.py").read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if text in line)


@pytest.mark.slow
@pytest.mark.ondemand  # CI: the same rank and line named through a two-node Slurm job (test_slurm_hangs.py)
def test_stacks_names_the_rank_that_sleeps_and_its_line(tmp_path: Path):
    mark = tmp_path / "asleep"
    process = _start(
        tmp_path / "run",
        env={"SLEEP_RANK": "1", "SLEEP_AT_STEP": "3", "SLEEP_S": "60", "SLEEP_MARK": str(mark)},
    )
    try:
        _wait_for(mark, process)
        time.sleep(1)  # rank 0 is now waiting for rank 1 inside the backward pass's all-reduce
        shown = subprocess.run(
            [PYTHON, "scripts/stacks.py", str(tmp_path / "run"), "--wait", "2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert shown.returncode == 0, shown.stderr
    line = _line_of('time.sleep(float(os.environ["SLEEP_S"]))')
    sleeping = f"rank 1: training_step at user_code.py:{line}"
    assert sleeping in shown.stdout, shown.stdout
    assert "rank 0: " in shown.stdout and "did not answer" not in shown.stdout, shown.stdout
    dumps = (tmp_path / "run" / "stacks" / "rank1.txt").read_text()
    assert "asked by scripts/stacks.py" in dumps and "in training_step" in dumps
    print(shown.stdout)


@pytest.mark.slow
def test_a_rank_that_does_not_arrive_within_the_timeout_is_named_with_where_it_was(tmp_path: Path):
    """... and the webhook (notify) is told once, by the rank that reports it."""
    from tests.test_notify import Webhook

    mark = tmp_path / "asleep"
    started = time.monotonic()
    webhook = Webhook()
    process = _start(
        tmp_path / "run",
        "dist.timeout_min=0.05",  # 3 s once the first step is done (the default, 30: test_settings.py)
        "dist.init_timeout_min=2",
        env={
            "SLEEP_RANK": "1",
            "SLEEP_AT_STEP": "3",
            "SLEEP_S": "120",
            "SLEEP_MARK": str(mark),
            "TORCH_FR_BUFFER_SIZE": "200",  # torch's flight recorder on (gloo's since torch 2.8)
            **webhook.env(),
        },
    )
    try:
        output, _ = process.communicate(timeout=100)
    finally:
        webhook.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode not in (0, None) and time.monotonic() - started < 100
    line = _line_of('time.sleep(float(os.environ["SLEEP_S"]))')
    stacks_dir = tmp_path / "run" / "stacks"
    expected = (
        f"rank 1 on {os.uname().nodename} (before its backward pass, training_step at user_code.py:{line}) did not "
        "arrive at a collective within dist.timeout_min=0.05 while the others waited for it at step 3 of epoch 0; "
    )
    assert expected in output, output[-4000:]
    assert f"every rank's stacks: {stacks_dir}/rank<N>.txt" in output and "Traceback" not in output
    # declared by hpctrain's watchdog before the timeout: on NCCL its own watchdog would end the
    # processes at the timeout itself, leaving no stacks and no sentence
    assert "no batch completed on rank " in (stacks_dir / "rank1.txt").read_text()
    assert "Timeout" not in output and "timed out" not in output
    (text,) = webhook.texts
    assert text.startswith(f"hpctrain: run hung: rank 1 on {os.uname().nodename} (before its backward pass")
    assert "did not arrive at a collective within dist.timeout_min=0.05" in text
    assert f"\nrun dir: {tmp_path / 'run'}\nhost: " in text
    _the_flight_record_was_written_by_every_rank(tmp_path / "run")


@pytest.mark.slow
def test_a_hang_in_the_sanity_check_is_named_within_seconds_of_being_declared(tmp_path: Path):
    """Positions are published from the run's setup on, not only while training: a rank asleep in the
    sanity check is named with where it was, and the sentence comes within the watchdog's poll, its wait for
    the stacks and a few seconds of the hang being declared (a read of a rank's position that was never
    published used to wait for the store's whole timeout, here 12 s, once per rank)."""
    from hpctrain.runtime.distributed.watchdog import POLL_S

    mark = tmp_path / "asleep"
    result = train(
        tmp_path,
        *user_overrides("SleepyRank"),
        "trainer=ddp_cpu",
        "trainer.max_epochs=1",
        "dist.init_timeout_min=0.2",  # until the first step; a preloaded rank 1 starts in a second
        env={
            "PYTHONPATH": str(ROOT),
            "SLEEP_IN": "sanity_check",
            "SLEEP_RANK": "1",
            "SLEEP_AT_STEP": "1",
            "SLEEP_S": "120",
            "SLEEP_MARK": str(mark),
        },
        timeout=100,
    )
    hung_for = time.time() - mark.stat().st_mtime  # from rank 1 falling asleep to the end of the job
    declared_after = 12 - 5  # watchdog.Stall: most of the timeout, 5 s ahead of it at the latest
    assert result.returncode not in (0, None)
    line = _line_of('time.sleep(float(os.environ["SLEEP_S"]))  # in validation')
    (run,) = run_dirs(tmp_path)
    expected = (
        f"rank 1 on {os.uname().nodename} (1 batch(es) behind, validation_step at user_code.py:{line}) did not "
        "arrive at a collective within dist.init_timeout_min=0.2 while the others waited for it at step 0 of "
        f"epoch 0; every rank's stacks: {run / 'stacks'}/rank<N>.txt"  # rank 0 in the first step's all-reduce
    )
    assert expected in result.stdout, result.stdout[-4000:]
    assert hung_for < declared_after + POLL_S + 3 + 5, hung_for  # 3: the wait for every rank's stacks


def test_a_rank_that_published_no_position_is_named_as_such_and_never_waited_for(
    monkeypatch: pytest.MonkeyPatch,
):
    """A rank stuck before the run's setup (its watchdog, which publishes, not started) has no key in the
    store, and a get of a missing key waits for the store's whole timeout (here a minute)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hpctrain.runtime import run_state
    from hpctrain.runtime.distributed import failures
    from hpctrain.runtime.distributed.job_store import POSITION_KEY

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(minutes=1), wait_for_workers=False
    )
    store.set(f"{POSITION_KEY}/0", "7 1 validate 2 30 node1")
    store.set(f"{POSITION_KEY}/2", "5 0 validate 2 30 node3")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    run_state.begin()  # a run of its own: no collective timeout recorded by an earlier test's run
    started = time.monotonic()
    try:
        line = failures._who_did_not_arrive(store, wait_s=0)
    finally:
        run_state.end()
    assert time.monotonic() - started < 5
    assert line == (
        "rank 1 (no position: it has not reached the run's setup); rank 2 on node3 (2 batch(es) behind) did not "
        "arrive at a collective while the others waited for them in validation at step 30 of epoch 2"
    )


def _the_flight_record_was_written_by_every_rank(run: Path) -> None:
    """torch writes its flight record only at NCCL's own timeout, which hpctrain's watchdog comes before:
    each rank wrote its own as the job ended, where and as torch would have (<run dir>/flight_recorder/
    rank<N>, pickled): rank 0's last collective is the all-reduce rank 1 never joined. (torch's reader,
    fr_trace, reads NCCL's records; gloo's name no process group in torch 2.14, which it cannot read:
    scripts/gpu_checks.py reads NCCL's back with it.)"""
    import pickle

    from torch._C import _distributed_c10d as c10d

    if not hasattr(c10d, "_dump_fr_trace"):
        pytest.skip("this torch keeps no flight record of gloo's collectives (torch 2.8 and later do)")
    folder = run / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0", "rank1"]
    records = {r: pickle.loads((folder / f"rank{r}").read_bytes()) for r in (0, 1)}
    last = {r: record["entries"][-1] for r, record in records.items()}
    assert last[0]["profiling_name"] == "gloo:all_reduce" and last[0]["state"] != "completed", last[0]
    assert last[0]["collective_seq_id"] > last[1]["collective_seq_id"]  # rank 1 never issued it


@pytest.mark.slow
def test_a_rank_slowed_by_a_sleeping_callback_is_named_as_a_straggler(tmp_path: Path):
    import csv

    import yaml

    run = tmp_path / "run"
    process = _start(
        run,
        "trainer.max_epochs=4",
        "+callbacks.slow._target_=tests.differential.user_code.SlowRankCallback",
        "diagnostics.straggler_every_s=1",
        "trainer.log_every_n_steps=1",
        env={
            "SLOW_RANK": "1",
            "SLOW_S": "0.05",
            "SLEEP_RANK": "-1",
            "SLEEP_AT_STEP": "-1",
            "SLEEP_S": "0",
            "SLEEP_MARK": "-",
        },
    )
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    assert f"straggler: rank 1 ({os.uname().nodename}) " in output, output[-4000:]
    assert "straggler: rank 0" not in output
    line = next(x for x in output.splitlines() if "straggler: rank 1" in x)
    share = int(line.split("), ")[1].split("%")[0])
    assert share > 60, (
        line
    )  # the sleep is in a batch-start hook: mostly between steps (76 % seen on a loaded CI core)
    with open(run / "metrics.csv", newline="") as file:
        rows = [r for r in csv.DictReader(file) if r.get("ranks/own_ms/1")]
    assert rows and all(float(r["ranks/own_ms/1"]) > 40 > float(r["ranks/own_ms/0"]) for r in rows)
    ranks = yaml.safe_load((run / "outcome.yaml").read_text())["ranks"]
    assert ranks[1]["own_ms_per_step"] > 40 > ranks[0]["own_ms_per_step"] and ranks[1]["steps"] == 40


DUMP = """Thread 0x00007fee37fff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007fef396a9b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "/home/me/project/src/my_project/models/model.py", line 41 in training_step
  File "/venv/lib/python3.11/site-packages/pytorch_lightning/loops/optimization/automatic.py", line 140 in closure
  File "/home/me/project/src/train.py", line 48 in <module>
"""


def test_every_rank_notes_its_process_in_a_file_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Appends of many nodes to one file on NFS are not atomic (their lines interleave or vanish): each
    rank writes `stacks/rank<N>.pid` whole, a restarted rank replaces its own, and a run of hpctrain 0.4
    or before (one `stacks/pids` for all) is still read."""
    import socket

    from hpctrain.runtime import run_state
    from hpctrain.runtime.distributed import stacks

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    host = socket.gethostname()
    for rank in (0, 1, 2, 1):  # rank 1 twice: its restart
        monkeypatch.setenv("RANK", str(rank))
        run_state.begin()
        try:
            stacks.register(tmp_path, "SIGURG")
        finally:
            run_state.end()
    folder = tmp_path / "stacks"
    assert sorted(p.name for p in folder.glob("*.pid")) == ["rank0.pid", "rank1.pid", "rank2.pid"]
    assert not (folder / "pids").exists() and not list(folder.glob(".*"))
    assert (folder / "rank1.pid").read_text() == f"1 {os.getpid()} {host}\n"
    assert stacks.known_ranks(tmp_path) == {r: (os.getpid(), host) for r in (0, 1, 2)}
    old = tmp_path / "old"
    (old / "stacks").mkdir(parents=True)
    (old / "stacks" / "pids").write_text("0 11 node1\n1 12 node2\n")
    assert stacks.known_ranks(old) == {0: (11, "node1"), 1: (12, "node2")}


def test_a_dump_is_summed_up_by_its_innermost_call_and_the_users_frame():
    from hpctrain.runtime.distributed import stacks

    frames = stacks.main_thread_frames(DUMP)
    assert frames[0][2] == "wrapper" and frames[-1][2] == "<module>"  # the thread running the program
    assert stacks.where(frames) == "wrapper in training_step at model.py:41"
    places = {r: "wrapper in training_step at model.py:41" for r in (0, 1, 2, 4, 5, 6, 7)}
    places[3] = "on_train_batch_start at user.py:12"
    assert stacks.summary(places) == (
        "ranks 0-2, 4-7: wrapper in training_step at model.py:41; rank 3: on_train_batch_start at user.py:12"
    )


def test_the_ranks_timing_is_read_without_waiting_for_a_rank_that_trained_no_step():
    """A job requeued after its last training step resumes with nothing left to train: its ranks publish
    no step clock, and rank 0's end-of-run summary must not wait for one until the store's timeout (the
    job hung there, its work done, until its time limit)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hpctrain.runtime.distributed.stragglers import TIMING_KEY, StragglerReport

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    store.set(f"{TIMING_KEY}/0", "79 0.5 1.5 node1")  # rank 1 trained no step in this attempt
    report = StragglerReport(world_size=2, every_s=30, factor=1.5)
    started = time.monotonic()
    assert report.read(store) == {0: (79, 0.5, 1.5, "node1")}
    assert time.monotonic() - started < 10  # not the store's 20 s timeout
