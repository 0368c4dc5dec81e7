"""What our checkpoints carry beyond Lightning's own: every rank's RNG and metric states, and the config.

Lightning 2.6 restores weights, optimizer, schedulers, loop counters and (for stateful loaders) the
dataloader position, but no random number generator and only rank 0's view of any metric. Without
them, a run resumed mid-epoch draws different dropout masks than the uninterrupted run, ends with
different weights, and reports a train/acc for part of the interrupted epoch. Everything
stored is plain tensors, numbers and strings, so checkpoints load with `weights_only=True`.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor
from torchmetrics import Metric

from hpctrain.errors import UserError

CONFIG_KEY = "hpctrain_config"


def capture_rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
        "python": {"version": version, "state": list(python_state), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    return [v.detach().cpu().clone() for v in value]


def capture_metric_states(module: LightningModule) -> dict[str, dict[str, Any]]:
    """The running states of every torchmetrics metric in `module` (this rank's share of the epoch)."""
    return {
        name: {key: _to_cpu(value) for key, value in metric.metric_state.items()}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric)
    }


def restore_metric_states(module: LightningModule, states: dict[str, dict[str, Any]]) -> None:
    for name, metric in module.named_modules():
        if isinstance(metric, Metric) and name in states:
            for key, value in states[name].items():
                moved = (
                    value.to(metric.device)
                    if isinstance(value, Tensor)
                    else [v.to(metric.device) for v in value]
                )
                setattr(metric, key, moved)


class CheckpointExtras(Callback):
    """Adds to every checkpoint what Lightning does not save:

    - each rank's RNG states and, for a checkpoint taken mid-epoch, its running metric states (so
      the resumed epoch's train/acc covers the whole epoch). Lightning builds the checkpoint on every
      rank (rank 0 writes it), so they are gathered there with one collective; each rank restores
      its own just before the first resumed step;
    - the resolved config (plain containers), from which `src/eval.py` rebuilds the model.

    It also checks, when training starts on several nodes, that every rank uses the same run dir
    and sees what rank 0 wrote there: a node-local log dir would leave the checkpoints where a
    requeued job, or another node, cannot find them.
    """

    def __init__(self, config: dict[str, Any] | None = None, run_dir: str | Path | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        self._trainer: Trainer | None = None
        self._pending: dict[str, Any] | None = None

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.config is not None:
            checkpoint[CONFIG_KEY] = self.config

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit" and trainer.num_nodes > 1 and self.run_dir is not None:
            check_run_dir_is_shared(trainer, self.run_dir)

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        state: dict[str, Any] = {"rng": capture_rng_state()}
        if trainer is not None and _mid_epoch(trainer):
            state["metrics"] = capture_metric_states(trainer.lightning_module)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, state)
            return {"per_rank": gathered}
        return {"per_rank": [state]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is None:
            return
        per_rank, self._pending = self._pending.get("per_rank", []), None
        if len(per_rank) != trainer.world_size:
            return  # resumed with another number of processes: nothing per rank to restore
        state = per_rank[trainer.global_rank]
        restore_rng_state(state["rng"])
        if "metrics" in state:
            restore_metric_states(pl_module, state["metrics"])


def check_run_dir_is_shared(trainer: Trainer, run_dir: Path) -> None:
    """Every rank must write to rank 0's run dir and see the run.yaml rank 0 wrote there.

    The verdicts are gathered, so every rank stops with the same sentence (none waits in a collective
    for a rank that already left).
    """
    expected = trainer.strategy.broadcast(str(run_dir), src=0)
    where = f"rank {trainer.global_rank} on {socket.gethostname()}"
    problem = ""
    if str(run_dir) != expected:
        problem = (
            f"{where} uses the run dir {run_dir} but rank 0 uses {expected}; set paths.log_dir to one "
            "directory on a filesystem every node mounts (not a node-local path such as $TMPDIR)."
        )
    elif not (run_dir / "run.yaml").is_file():
        problem = (
            f"{where} cannot see {run_dir}/run.yaml, which rank 0 wrote: the run dir is not on a filesystem "
            "every node mounts; set paths.log_dir to a shared directory."
        )
    verdicts: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(verdicts, problem)
    first = next((v for v in verdicts if v), None)
    if first:
        raise UserError(first)


def _mid_epoch(trainer: Trainer) -> bool:
    """Whether some, but not all, training batches of the current epoch are done."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return trainer.training and 0 < done < trainer.num_training_batches
