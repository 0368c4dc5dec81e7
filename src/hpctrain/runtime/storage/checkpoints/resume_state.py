"""What hpctrain adds to every checkpoint (the callback
`hpctrain.callbacks.resume_state.ResumeState`): each rank's RNG states and, mid-epoch,
its running metric states (Lightning restores weights, optimizer, schedulers, loop counters and stateful
dataloaders, but no random number generator and only rank 0's view of a metric), plus the resolved config
that eval, predict, export and `hpctrain.load` rebuild the run from. All of it is plain tensors, numbers
and strings.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning_fabric.utilities.types import _Stateful  # a structural protocol: any namespace's loader
from torch import Tensor
from torchmetrics import Metric

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger(__package__)


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


def resumes_mid_epoch(loader: Any) -> bool:
    """Whether Lightning restores this loader's position within an epoch (it has state_dict/load_state_dict)."""
    return isinstance(loader, _Stateful)


def mid_epoch(trainer: Trainer) -> bool:
    """Whether some, but not all, training batches of the current epoch are done."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return trainer.training and 0 < done < trainer.num_training_batches
