"""What our checkpoints carry beyond Lightning's own: every rank's RNG states, and the run's config.

Lightning 2.6 restores weights, optimizer, schedulers, loop counters and (for stateful loaders) the
dataloader position, but no random number generator. Without them, a run resumed mid-epoch draws
different dropout masks than the uninterrupted run and ends with different weights. Everything
stored is plain tensors, numbers and strings, so checkpoints load with `weights_only=True`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer

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


class RNGStateCheckpoint(Callback):
    """Saves each rank's RNG states in the checkpoint; restores them just before the first resumed step.

    Lightning builds the checkpoint on every rank (and writes it on rank 0), so the states are
    gathered there with one collective.
    """

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = capture_rng_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, state)
            return {"per_rank": gathered}
        return {"per_rank": [state]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("per_rank")

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is None:
            return
        states, self._pending = self._pending, None
        if len(states) == trainer.world_size:
            restore_rng_state(states[trainer.global_rank])


class ConfigInCheckpoint(Callback):
    """Stores the resolved config (plain containers) so `src/eval.py` can rebuild the model from it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CONFIG_KEY] = self.config
