"""Optimizer and learning-rate schedule from config factories, for any LightningModule of the template.

The configs give `_partial_` factories (model/optimizer/*.yaml, model/scheduler/*.yaml); the length
of a schedule is the one thing a config cannot know, so `T_max` (cosine) and `total_steps`
(one-cycle) left null are filled in from the trainer: its total optimizer steps for a per-step
schedule, its epochs for a per-epoch one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.optim import Optimizer

# constructor arguments that mean "the length of the run", per schedule class name
LENGTH_ARGUMENTS = {"CosineAnnealingLR": "T_max", "OneCycleLR": "total_steps"}


def configure(
    module: Any,
    parameters: Iterable[nn.Parameter],
    optimizer: Callable[..., Optimizer],
    scheduler: Callable[..., Any] | None = None,
    interval: str = "epoch",
) -> Any:
    """What `LightningModule.configure_optimizers` returns: the optimizer, plus its schedule if any."""
    built = optimizer(params=parameters)
    if not scheduler:  # null, or the empty node of model/scheduler=none
        return built
    keywords: dict[str, Any] = {}
    target = scheduler.func if isinstance(scheduler, functools.partial) else scheduler
    length = LENGTH_ARGUMENTS.get(getattr(target, "__name__", ""))
    if length and isinstance(scheduler, functools.partial) and scheduler.keywords.get(length) is None:
        trainer = module.trainer
        keywords[length] = int(
            trainer.estimated_stepping_batches if interval == "step" else max(trainer.max_epochs, 1)
        )
    return {
        "optimizer": built,
        "lr_scheduler": {"scheduler": scheduler(optimizer=built, **keywords), "interval": interval},
    }
