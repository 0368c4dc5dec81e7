"""Nothing lost: a training process SIGKILLed at each step of every checkpoint save, for single files and
sharded folders, written synchronously and asynchronously (tests/kill_saves.py does the killing).

After each kill, the folder as the kill left it must hold a complete checkpoint under every name the run
relies on, and a restart (the SLURM requeue's own choice, `start_point`) must resume from the newest
checkpoint that was committed before the kill, never from an older one, never from a half-written one.
One restart per sharded variant runs for real, from the moment between the two renames of a commit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from hpctrain.runtime.storage.checkpoints import checkpoint_dir, reading, start_point
from hpctrain.runtime.storage.checkpoints.folders import committed
from tests.helpers import ROOT, assert_ok, train

pytestmark = pytest.mark.slow

TINY = (
    "experiment=quickstart",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "+trainer.enable_model_summary=false",
    "callbacks.performance=null",
    "callbacks.progress=null",
    "test=false",
    "num_threads=1",  # a fork after a threaded parallel region can hang (OpenMP)
    "~logger",
    "monitor.metric=val/loss",  # a new best at each of the two validations: the old one is removed
    "monitor.mode=min",
)
VARIANTS = {
    "file, sync": ("trainer=cpu",),
    "file, async": ("trainer=cpu", "checkpoints.async_save=true"),
    "folder, sync": ("trainer=fsdp_cpu", "trainer.devices=1"),
    "folder, async": ("trainer=fsdp_cpu", "trainer.devices=1", "checkpoints.async_save=true"),
}
JOB = "4242"  # the SLURM job id the restarts below present


def _kills(tmp_path: Path, variant: str) -> list[Path]:
    out = tmp_path / "kills"
    result = train(
        tmp_path / "logs",
        *TINY,
        *VARIANTS[variant],
        "+callbacks.kill_points._target_=tests.kill_saves.KillPoints",
        f"+callbacks.kill_points.out={out}",
        "+callbacks.kill_points.folder=${paths.output_dir}/checkpoints",
        env={"PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert_ok(result)
    summary = json.loads((out / "kill-points.json").read_text())
    assert summary["exit_status"] == 0, summary
    if summary["crashes"]:  # a child that died before its kill point was run again: say so
        print(f"{variant}: children that died before their kill point, run again: {summary['crashes']}")
    return [out / f"kill-{k}" for k in range(1, summary["kills"] + 1)]


def _as_killed_run(kill: Path, run: Path) -> Path:
    """A run dir holding the folder as the kill left it, whose run.yaml records an attempt of SLURM job
    JOB: the restart below is that job requeued."""
    shutil.copytree(kill / "checkpoints", checkpoint_dir(run), symlinks=True)
    (run / "run.yaml").write_text(yaml.safe_dump({"attempts": [{"slurm_job_id": JOB}]}))
    return run


def _callback_paths(content: dict) -> list[str]:
    """The checkpoints a checkpoint's ModelCheckpoint state names: its best, its last, its top k."""
    state = next(
        (v for k, v in (content.get("callbacks") or {}).items() if k.startswith("ModelCheckpoint")), {}
    )
    return [
        p
        for p in (state.get("best_model_path"), state.get("last_model_path"), *state.get("best_k_models", {}))
        if p
    ]


# CI runs two of the four, each kind and each way once (file sync, folder async); the others on demand
IN_CI = ("file, sync", "folder, async")


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=() if v in IN_CI else pytest.mark.ondemand) for v in VARIANTS]
)
def test_a_kill_at_any_step_of_a_save_loses_nothing(variant: str, tmp_path: Path):
    kills = _kills(tmp_path, variant)
    steps = [(k / "killed-before.txt").read_text().strip('"') for k in kills]
    # every step of the commit protocol was a kill point: the write, the rename into place, the old best's
    # removal, and for folders the old checkpoint set aside and removed
    kinds = {step.split()[0] for step in steps}
    assert ({"write", "remove"} if variant.startswith("file") else {"mkdir", "rmtree"}) <= kinds, steps
    assert ("replace last.ckpt" if variant.startswith("file") else "rename last.ckpt") in steps, steps
    if variant.startswith("folder"):
        assert any(s.startswith("rename .last.ckpt.old-") for s in steps), steps
    between_renames = None
    for kill, step in zip(kills, steps, strict=True):
        journal = json.loads((kill / "journal.json").read_text())
        run = _as_killed_run(kill, tmp_path / "runs" / kill.name)
        chosen = start_point(None, run, tmp_path / "runs", env={"SLURM_JOB_ID": JOB}).checkpoint
        if not journal:  # killed before the first commit: nothing to lose, a fresh start
            assert chosen is None, (step, chosen)
            continue
        assert chosen is not None, (step, journal)
        content = reading.read(chosen, weights=False)  # whole: every shard, every item, weights_only
        newest = max(entry_step for _, entry_step in journal)
        assert content["global_step"] == newest, (step, chosen, journal)
        for named in _callback_paths(content):  # the best it tests after fit, the last it names
            found = committed(checkpoint_dir(run) / Path(named).name)
            assert found is not None, (step, named, sorted(p.name for p in checkpoint_dir(run).iterdir()))
            reading.read(found, weights=False)
        if not (checkpoint_dir(run) / "last.ckpt").exists() and committed(checkpoint_dir(run) / "last.ckpt"):
            between_renames = run
    if variant.startswith("folder"):
        assert between_renames is not None  # the kill between a commit's two renames was met
        _restart_really_resumes(between_renames, tmp_path, variant)


def _restart_really_resumes(run: Path, tmp_path: Path, variant: str) -> None:
    """The run dir a kill left between the two renames of last.ckpt's commit, continued for real: it
    resumes from the checkpoint set aside and completes its two epochs."""
    before = reading.read(committed(checkpoint_dir(run) / "last.ckpt"), weights=False)["global_step"]
    result = train(
        tmp_path / "restart-logs",
        *TINY,
        *VARIANTS[variant],
        f"hydra.run.dir={run}",
        f"ckpt_path={checkpoint_dir(run) / 'last.ckpt'}",
        timeout=300,
    )
    assert_ok(result)
    assert "its save was interrupted; reading the complete checkpoint it replaced" in result.stdout
    after = reading.read(checkpoint_dir(run) / "last.ckpt", weights=False)["global_step"]
    assert before < after == 4, (before, after)
    assert not list(
        checkpoint_dir(run).glob(".last.ckpt.old-*")
    )  # the next commit cleared what was set aside
