"""The run dir: resume-point selection, the run record, and logs that a restarted run appends to."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from hpctrain.loggers import ResumableCSVLogger, stable_run_key
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage import checkpoints, records
from tests.helpers import read_metrics


def _ckpt(run_dir: Path, name: str, age_s: float = 0) -> Path:
    path = run_dir / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def _record(run: Path, job: str | None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    attempt = {"started": "2026-01-01 00:00:00", "slurm_job_id": job, "run_id": f"slurm-{job}"}
    (run / "run.yaml").write_text(yaml.safe_dump({"attempts": [attempt]}))


SLURM_7 = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}


def test_a_requeued_job_continues_from_its_own_newest_checkpoint(tmp_path: Path):
    run = tmp_path / "runs" / "slurm-7"
    _record(run, "7")
    _ckpt(run, "last.ckpt", age_s=60)
    requeue = _ckpt(run, "requeue.ckpt")
    other = _ckpt(tmp_path / "runs" / "slurm-8", "requeue.ckpt", age_s=-60)  # newer, but another job's
    start = checkpoints.start_point(None, run, tmp_path / "runs", env=SLURM_7)
    assert start.checkpoint == requeue and "restart 1" in start.describe()
    # the first attempt's ckpt_path does not matter any more: the job continues its own run
    assert checkpoints.start_point(str(other), run, tmp_path / "runs", env=SLURM_7).checkpoint == requeue


def test_a_run_dir_with_another_runs_checkpoints_is_refused(tmp_path: Path):
    run = tmp_path / "runs" / "fixed"
    _record(run, None)
    last = _ckpt(run, "last.ckpt")
    elsewhere = _ckpt(tmp_path / "runs" / "b", "last.ckpt")
    with pytest.raises(UserError, match=r"this run dir already holds checkpoints of another run"):
        checkpoints.start_point(None, run, tmp_path / "runs", env={})
    with pytest.raises(UserError, match=rf"ckpt_path={elsewhere} conflicts with the checkpoints"):
        checkpoints.start_point(str(elsewhere), run, tmp_path / "runs", env={})
    with pytest.raises(UserError, match="does not exist"):
        checkpoints.start_point(str(tmp_path / "missing.ckpt"), run, tmp_path / "runs", env={})
    # naming one of its own checkpoints continues that run, on purpose
    assert checkpoints.start_point(str(last), run, tmp_path / "runs", env={}).checkpoint == last
    # another SLURM job in the same (fixed) dir is another run too
    with pytest.raises(UserError, match="another run"):
        checkpoints.start_point(None, run, tmp_path / "runs", env={**SLURM_7, "SLURM_JOB_ID": "9"})


def test_a_fresh_run_starts_cleanly_or_from_what_it_was_given(tmp_path: Path):
    runs = tmp_path / "runs"
    fresh = runs / "new"
    assert checkpoints.start_point(None, fresh, runs, env={}).checkpoint is None
    with pytest.raises(UserError, match="ckpt_path=last but no earlier run"):
        checkpoints.start_point("last", fresh, runs, env={})
    _ckpt(runs / "a", "last.ckpt", age_s=100)
    newest = _ckpt(runs / "b", "last.ckpt", age_s=10)
    assert checkpoints.start_point("last", fresh, runs, env={}).checkpoint == newest
    assert checkpoints.start_point(str(newest), fresh, runs, env={}).checkpoint == newest
    with pytest.raises(UserError, match="does not exist"):
        checkpoints.start_point(str(tmp_path / "missing.ckpt"), fresh, runs, env={})


def _task(rank: int, restart: int = 1) -> dict[str, str]:
    """Task `rank` of a two-task srun step of SLURM job 4242, in its attempt `restart`."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_RESTART_COUNT": str(restart),
    }


def _killed_between_renames(run: Path) -> Path:
    """A run dir as a kill between a folder commit's two renames leaves it: last.ckpt set aside (complete),
    its successor still staged under the job's earlier attempt's name, an older best beside them."""
    _record(run, "4242")
    folder = run / "checkpoints"
    aside = folder / ".last.ckpt.old-7f3a"
    for shard in (aside, folder / ".last.ckpt.tmp-8e41@slurm4242"):
        shard.mkdir(parents=True)
        (shard / "__0_0.distcp").write_bytes(b"x")
    _ckpt(run, "epoch_000.ckpt", age_s=60)
    return aside


@pytest.mark.slow  # waits on timers (the quick tier waits on none)
def test_every_rank_resumes_from_rank_0s_choice_after_a_kill_mid_commit(tmp_path: Path):
    """While rank 0 tidies the folder (the abandoned staging removed), rank 1 waits for its choice and uses
    it, whatever the folder shows rank 1 afterwards (here, a newer file, as a node's stale or newer view
    could); the choice of an earlier attempt is never taken for this one's."""
    import threading

    run = tmp_path / "runs" / "slurm-4242"
    aside = _killed_between_renames(run)
    told: list[checkpoints.StartPoint] = []
    rank_1 = threading.Thread(
        target=lambda: told.append(
            checkpoints.start_point(None, run, tmp_path / "runs", env=_task(1), wait_s=30)
        )
    )
    rank_1.start()  # first: it waits
    time.sleep(0.5)
    assert rank_1.is_alive() and not told
    chosen = checkpoints.start_point(None, run, tmp_path / "runs", env=_task(0))
    rank_1.join(timeout=10)
    assert chosen.checkpoint == aside and [t.checkpoint for t in told] == [aside]
    assert not list((run / "checkpoints").glob(".*.tmp-*"))  # rank 0 removed the abandoned staging

    _ckpt(run, "epoch_001.ckpt", age_s=-30)  # what rank 1 would choose now, by itself
    late = checkpoints.start_point(None, run, tmp_path / "runs", env=_task(1), wait_s=5)
    assert (late.checkpoint, late.reason) == (aside, chosen.reason)
    with pytest.raises(UserError, match=r"rank 1 on .* waited 0 s for rank 0 to record which checkpoint"):
        checkpoints.start_point(None, run, tmp_path / "runs", env=_task(1, restart=2), wait_s=0.3)


def test_ranks_wait_for_rank_0_only_where_the_choice_is_made_from_folders(tmp_path: Path):
    """A first attempt starts fresh (or from the named file) on every rank alike: no waiting, and nothing
    written in the run dir; ckpt_path=last is chosen from folders other runs may be writing: it waits."""
    runs = tmp_path / "runs"
    fresh = runs / "slurm-4242"
    fresh.mkdir(parents=True)
    assert checkpoints.start_point(None, fresh, runs, env=_task(1, restart=0), wait_s=0).checkpoint is None
    assert checkpoints.start_point(None, fresh, runs, env=_task(0, restart=0)).checkpoint is None
    assert list(fresh.iterdir()) == []
    newest = _ckpt(runs / "b", "last.ckpt", age_s=10)
    assert checkpoints.start_point("last", fresh, runs, env=_task(0, restart=0)).checkpoint == newest
    _ckpt(runs / "c", "last.ckpt", age_s=5)  # another run saved since: rank 1 still takes rank 0's
    assert (
        checkpoints.start_point("last", fresh, runs, env=_task(1, restart=0), wait_s=5).checkpoint == newest
    )


def test_the_local_launchers_ranks_inherit_rank_0s_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from hpctrain.runtime.storage.checkpoints import agreement

    runs = tmp_path / "runs"
    run = runs / "2026-01-01_00-00-00.000"
    first = _ckpt(runs / "a", "last.ckpt", age_s=10)
    monkeypatch.delenv(agreement.INHERITED, raising=False)
    for key in ("SLURM_JOB_ID", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert checkpoints.start_point("last", run, runs).checkpoint == first  # rank 0, this process
    _ckpt(runs / "b", "last.ckpt")  # saved before Lightning starts local rank 1
    child = {"LOCAL_RANK": "1", agreement.INHERITED: os.environ[agreement.INHERITED]}
    assert checkpoints.start_point("last", run, runs, env=child).checkpoint == first


def test_of_checkpoints_saved_in_one_tick_of_the_clock_every_process_chooses_alike(tmp_path: Path):
    """Lustre keeps whole seconds: requeue.ckpt, then last.ckpt (or the one set aside for it), then the
    later name, never the order of a set of names (which differs from process to process)."""
    run = tmp_path / "run"
    paths = [_ckpt(run, name) for name in ("epoch_002.ckpt", "last.ckpt", "requeue.ckpt", "epoch_001.ckpt")]
    tick = 1_700_000_000 * 10**9
    for path in paths:
        os.utime(path, ns=(tick, tick))
    assert checkpoints.newest_checkpoint(run) == run / "checkpoints" / "requeue.ckpt"
    (run / "checkpoints" / "requeue.ckpt").unlink()
    assert checkpoints.newest_checkpoint(run) == run / "checkpoints" / "last.ckpt"
    aside = run / "checkpoints" / ".last.ckpt.old-1"
    (run / "checkpoints" / "last.ckpt").rename(aside)
    assert checkpoints.newest_checkpoint(run) == aside
    aside.unlink()
    assert checkpoints.newest_checkpoint(run) == run / "checkpoints" / "epoch_002.ckpt"


def test_an_unwritable_run_dir_is_refused(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match=rf"the run dir {blocker}/run is not writable"):
        records.check_writable(blocker / "run")


def test_run_record_keeps_every_attempt(tmp_path: Path):
    cfg = OmegaConf.create({"seed": 1, "model": {"lr": "${seed}"}})
    for _ in range(2):
        records.write_run_record(cfg, tmp_path, ["seed=1"], tmp_path, world_size=4)
    record = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert len(record["attempts"]) == 2 and record["attempts"][0]["world_size"] == 4
    assert record["overrides"] == ["seed=1"] and "torch" in record["versions"]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"seed": 1, "model": {"lr": 1}}


def test_csv_logger_appends_when_a_run_continues(tmp_path: Path):
    first = ResumableCSVLogger(str(tmp_path))
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.save()
    second = ResumableCSVLogger(str(tmp_path))  # the requeued job, same run dir
    second.log_metrics({"train/loss": 0.5, "val/acc": 0.9}, step=1)
    second.save()
    rows = read_metrics(tmp_path)
    assert [r["train/loss"] for r in rows] == ["1.0", "0.5"] and rows[1]["val/acc"] == "0.9"


def test_logger_ids_follow_the_run_dir(tmp_path: Path):
    assert stable_run_key(tmp_path / "slurm-7") == stable_run_key(tmp_path / "slurm-7")
    assert stable_run_key(tmp_path / "slurm-7") != stable_run_key(tmp_path / "slurm-8")


def test_a_checkpoint_keeps_the_plain_hyperparameters_and_reads_back_weights_only(tmp_path: Path):
    """What save_hyperparameters() recorded is written as plain values (a network and partial optimizers
    left out and named; paths as strings; OmegaConf as plain containers); the file loads weights-only."""
    import functools

    import torch

    from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO, plain_hyperparameters

    recorded = {
        "net": torch.nn.Linear(2, 2),
        "optimizer": functools.partial(torch.optim.SGD, lr=0.1),
        "lr": 0.1,
        "sizes": [1, 2],
        "root": Path("/data/x"),
        "extra": OmegaConf.create({"depth": 3}),
        "layers": [torch.nn.ReLU()],
    }
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": recorded, "hparams_type": dict}
    plain, left_out = plain_hyperparameters(checkpoint)
    assert plain["hyper_parameters"] == {"lr": 0.1, "sizes": [1, 2], "root": "/data/x", "extra": {"depth": 3}}
    assert left_out == ["net (Linear)", "optimizer (partial SGD)", "layers (list)"]
    assert "hparams_type" not in plain and checkpoint["hyper_parameters"] is recorded  # the original kept
    AtomicCheckpointIO().save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    loaded = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert loaded["hyper_parameters"] == plain["hyper_parameters"]


def test_an_object_a_checkpoint_could_not_be_read_back_with_is_refused_before_writing(tmp_path: Path):
    import torch

    from hpctrain.runtime.storage.checkpoints.reading import UnreadableCheckpoint
    from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO

    checkpoint = {"state_dict": {"w": torch.ones(2)}, "callbacks": {"Mine": {"seen": torch.nn.ReLU()}}}
    said = r"checkpoint's callbacks\.Mine\.seen \(from callback Mine's state_dict\) holds a torch\.nn\."
    with pytest.raises(UnreadableCheckpoint, match=said):
        AtomicCheckpointIO().save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    assert not list(tmp_path.iterdir())
    # what a scheduler written with numpy leaves in the optimizer's state is saved as plain numbers
    numpy = {"state_dict": {}, "optimizer_states": [{"param_groups": [{"lr": np.float64(0.1)}], "state": {}}]}
    numpy["lr_schedulers"] = [{"_last_lr": [np.float64(0.1)], "base": np.ones(2)}]
    AtomicCheckpointIO().save_checkpoint(numpy, tmp_path / "numpy.ckpt")
    saved = torch.load(tmp_path / "numpy.ckpt", weights_only=True)
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1
    assert type(saved["lr_schedulers"][0]["_last_lr"][0]) is float
    assert torch.equal(saved["lr_schedulers"][0]["base"], torch.ones(2, dtype=torch.float64))


def test_eval_composes_the_options_and_values_a_checkpoint_proposes_and_the_command_line_wins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """The options a checkpoint was trained with and its values come back for eval, composed by this
    project's configs: a value the command line gives wins, and a place (a data folder) is this command's."""
    import torch

    from hpctrain.runtime.storage.checkpoints.reading import CONFIG_KEY, config_from_checkpoint

    stored = {
        "choices": {"model": "mnist_cnn", "model/net": "mnist_cnn", "data": "digits"},
        "model": {"net": {"dropout": 0.25}, "optimizer": {"lr": 0.1}},
        "data": {"batch_size": 32, "data_dir": "/cluster/scratch/data"},
        "monitor": {"metric": "val_loss", "mode": "min"},
    }
    torch.save({"state_dict": {}, CONFIG_KEY: stored}, tmp_path / "last.ckpt")
    cfg = OmegaConf.create({"model": {}, "data": {}, "monitor": {"metric": "val/acc", "mode": "max"}})
    with caplog.at_level("INFO"):
        given = ["model.optimizer.lr=0.5", f"paths.data_dir={tmp_path}", "trainer.max_epochs=3"]
        cfg, options = config_from_checkpoint(cfg, tmp_path / "last.ckpt", given)
    assert cfg.model._target_ == "myproject.models.classifier.ImageClassifier"  # the project's, as composed
    assert (cfg.model.net.dropout, cfg.model.optimizer.lr, cfg.data.batch_size) == (0.25, 0.5, 32)
    assert (cfg.monitor.metric, cfg.monitor.mode) == ("val_loss", "min")
    assert "trainer" not in cfg  # only the groups a checkpoint proposes are composed
    assert options == stored["choices"]  # what the run's summary shows as its options
