"""Checkpoints, in one place: their names and folder and which one a run starts from (here, no torch:
the choice is made in preflight); how they are written (`writing`), what hpctrain adds to them
(`resume_state`: what makes a resume exact) and how they are read (`reading`).

    <run dir>/checkpoints/last.ckpt       the newest state, at the end of every epoch and of fit
    <run dir>/checkpoints/epoch_NNN.ckpt  the best epoch so far (monitor.metric, monitor.mode)
    <run dir>/checkpoints/requeue.ckpt    where a preempted or timed-out job stopped

The folder is `checkpoint_dir(run_dir)` and nothing else: the model_checkpoint callback's `dirpath`
must be it (hpctrain.runtime.run.build refuses another), so a restarted job always finds its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.config.settings import InitFrom, unset
from hpctrain.runtime.environment import launched
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import agreement
from hpctrain.runtime.storage.checkpoints.folders import committed, recover
from hpctrain.runtime.storage.records import read_run_record

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule

log = logging.getLogger("hpctrain")

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
REQUEUE_CHECKPOINT = "requeue.ckpt"
RESUMABLE = (REQUEUE_CHECKPOINT, LAST_CHECKPOINT)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in this run dir, if any: requeue.ckpt or last.ckpt, or the best
    epoch's when a kill fell between saving it and saving last.ckpt again; each a file or a folder, and
    for a folder whose commit a kill interrupted, the complete one it replaced (`committed`). Of two saved
    within the same tick of the filesystem's clock (a second on Lustre), requeue.ckpt, then last.ckpt, then
    the later name: the same on every rank and in every process."""
    folder = checkpoint_dir(run_dir)
    saved = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    names = sorted({*RESUMABLE, *saved})
    found = [p for name in names if (p := committed(folder / name)) is not None]
    return max(found, key=_recency) if found else None


def _recency(path: Path) -> tuple[int, int, str]:
    name = path.name.lstrip(".").split(".old-")[0]  # a folder set aside counts under its own name
    return path.stat().st_mtime_ns, RESUMABLE[::-1].index(name) + 1 if name in RESUMABLE else 0, name


@dataclass(frozen=True)
class StartPoint:
    checkpoint: Path | None
    reason: str
    run_dir: Path | None = None

    def prepare(self, model: LightningModule, model_cfg: DictConfig, init: InitFrom) -> None:
        """Before fit, in order: check the checkpoint the run continues from against the model and its
        config (or load `init_from`'s weights into a fresh start), remove partial saves of an earlier
        attempt, and say (rank 0) where the run starts and what a resumed checkpoint overrides. (What
        `init_from.freeze` names was frozen as the run was built: `run.callbacks.freezing`.)"""
        lines: list[str] = []
        warning = None
        if self.checkpoint is not None:
            warning = self._check_checkpoint(model, model_cfg)
            if init.path:
                lines.append(f"init_from.path={init.path} skipped: the run continues from {self.checkpoint}")
        elif init.path:  # a fresh run starts from init_from's weights
            from hpctrain.runtime.storage.checkpoints import init_from

            lines.append(
                init_from.apply(
                    model, init.path, strict=init.strict, exclude=init.exclude, prefix=init.prefix
                )
            )
        if launched.is_rank_zero():
            if self.run_dir is not None:
                remove_partial_saves(self.run_dir)
            for line in (self.describe(), *lines):
                log.info(line)
            if warning:
                log.warning(warning)

    def check_readable(self, init_from: str | None = None) -> None:
        """The file the run starts from, read as data before anything heavy is built (a checkpoint's
        contents without its weights, or `init_from.path`'s): a hostile or broken file is one sentence
        before the data is prepared."""
        from hpctrain.runtime.storage.checkpoints import init_from as weights
        from hpctrain.runtime.storage.checkpoints import reading

        if self.checkpoint is not None:
            reading.read(self.checkpoint, weights=False)
        elif not unset(init_from):
            weights.check_readable(str(init_from))

    def _check_checkpoint(self, model: LightningModule, model_cfg: DictConfig) -> str | None:
        """Refuse weights of another model; the configured optimizer values the checkpoint overrides."""
        from hpctrain.runtime.storage.checkpoints import reading

        assert self.checkpoint is not None
        # read once, for both checks (a folder: shapes only)
        content = reading.read(self.checkpoint, weights=False)
        reading.check_matches_model(self.checkpoint, model, content=content)
        configured = OmegaConf.to_container(model_cfg, resolve=True)
        return reading.resume_overrides(self.checkpoint, configured, content=content)

    def describe(self) -> str:
        if self.checkpoint:
            return f"starting from {self.checkpoint} ({self.reason})"
        return f"starting fresh ({self.reason})"


def is_restart(record: Mapping[str, Any], env: Mapping[str, str] | None = None) -> bool:
    """Whether this process continues the run recorded in run.yaml: the same SLURM job, requeued, or
    the same torchrun run, restarted by its agent."""
    attempts = record.get("attempts") or []
    job = launched.slurm_job_id(env)
    if job is not None and any(str(a.get("slurm_job_id")) == job for a in attempts):
        return True
    restarts = launched.torchrun_restart_count(env)
    run = launched.run_id(env)
    return restarts > 0 and any(a.get("run_id") == run for a in attempts)


def start_point(
    ckpt_path: str | None,
    run_dir: str | Path,
    runs_root: str | Path,
    env: Mapping[str, str] | None = None,
    init_from: str | None = None,
    wait_s: float | None = None,
) -> StartPoint:
    """What `trainer.fit` starts from; refuses, in one sentence, everything ambiguous.

    1. A restarted job (the same SLURM job id, requeued) continues from its run dir's newest checkpoint,
       whatever `ckpt_path` its first attempt was given.
    2. Otherwise a run dir that already holds checkpoints belongs to another run: it is refused, unless
       `ckpt_path` names one of those very checkpoints (continuing that run, in its dir, on purpose).
    3. `ckpt_path=last`: the newest last.ckpt / requeue.ckpt of this task's earlier runs.
    4. `ckpt_path=<file>`, which must exist; none: a fresh start.

    Global rank 0 chooses, and every other rank of the job uses its choice (`agreement`): the ranks look
    at the folders at different moments, through different nodes' filesystem caches, while rank 0 tidies
    what an interrupted save left and other runs write theirs, so a choice of their own could differ.
    `wait_s`: how long another rank waits for rank 0's (default `AGREE_WAIT_S`).
    """
    run_dir = Path(run_dir)
    given = None if unset(ckpt_path) else str(ckpt_path)
    shared = agreement.needed(given, env)
    if not launched.is_rank_zero(env):
        told = agreement.rank_zeros_choice(run_dir, shared, env, AGREE_WAIT_S if wait_s is None else wait_s)
        if told is not None:
            checkpoint, reason = told
            return StartPoint(Path(checkpoint) if checkpoint else None, reason, run_dir)
    chosen = _choose(given, run_dir, runs_root, env, init_from)
    if launched.is_rank_zero(env):
        agreement.tell(run_dir, chosen.checkpoint, chosen.reason, shared, env)
    return chosen


AGREE_WAIT_S = 300.0  # how long a rank waits for rank 0's choice (its imports and preflight come first)


def _choose(
    given: str | None,
    run_dir: Path,
    runs_root: str | Path,
    env: Mapping[str, str] | None,
    init_from: str | None,
) -> StartPoint:
    point = partial(StartPoint, run_dir=run_dir)
    if launched.is_rank_zero(env):
        recover(checkpoint_dir(run_dir), env)  # tidy only: the choice below needs no repair (`committed`)
    own = newest_checkpoint(run_dir)
    if given is not None and not unset(init_from):
        raise UserError(
            f"ckpt_path={given} and init_from.path={init_from} are both given: ckpt_path continues a run (its "
            "optimizer, epoch and schedule), init_from starts a new one from weights; pass one of them."
        )
    if own is not None:
        record = read_run_record(run_dir)
        if is_restart(record, env):
            return point(
                own,
                f"restart {launched.restart_count(env) or launched.torchrun_restart_count(env)} of this job",
            )
        if given is not None and given != "last":
            path = existing_checkpoint(given)
            if path.resolve().parent == checkpoint_dir(run_dir).resolve():
                return point(path, f"ckpt_path={given}, in this run dir")
        previous = (record.get("attempts") or [{}])[-1]
        started = previous.get("started", "an earlier run")
        conflict = f"ckpt_path={given} conflicts with the" if given else "this run dir already holds"
        fresh = (
            "pass a new --rdzv-id to torchrun on every node (the run dir is named after it)"
            if launched.launcher(env) == launched.TORCHRUN
            else "start in a new run dir (drop the fixed hydra.run.dir)"
        )
        raise UserError(
            f"{conflict} checkpoints of another run in {run_dir} (started {started}); pass ckpt_path={own} "
            f"to continue that run there, or {fresh}."
        )
    if given is None:
        return point(None, "no checkpoint given")
    if given == "last":
        here = run_dir.resolve()
        candidates = [
            p
            for run in Path(runs_root).glob(f"*/{CHECKPOINT_DIR}")
            for name in RESUMABLE
            if run.parent.resolve() != here and (p := committed(run / name)) is not None
        ]
        if not candidates:
            raise UserError(
                f"ckpt_path=last but no earlier run under {runs_root} has a last.ckpt; "
                "train once without ckpt_path, or pass ckpt_path=<path/to/file.ckpt>."
            )
        return point(
            max(candidates, key=lambda p: p.stat().st_mtime), "ckpt_path=last: the newest earlier run"
        )
    return point(existing_checkpoint(given), f"ckpt_path={given}")


def existing_checkpoint(ckpt_path: str | None) -> Path:
    if unset(ckpt_path):
        raise UserError("ckpt_path is required: pass ckpt_path=<path/to/file.ckpt>.")
    path = Path(str(ckpt_path)).expanduser()
    found = committed(path)
    if found is None:
        raise UserError(
            f"ckpt_path={ckpt_path} does not exist; pass the path of a .ckpt file or folder (see <run dir>/checkpoints/)."
        )
    if found != path:
        log.info("%s: its save was interrupted; reading the complete checkpoint it replaced, %s", path, found)
    return found


def remove_partial_saves(run_dir: str | Path) -> None:
    """Delete what checkpoint saves killed mid-write left behind (never a complete checkpoint, never a
    write of another job or live process: `folders.recover`)."""
    recover(checkpoint_dir(run_dir))
