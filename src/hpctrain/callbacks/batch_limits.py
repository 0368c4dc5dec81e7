"""`BatchLimits`: a fraction of a split (`trainer.limit_val_batches=0.1`) that comes to less than one
batch is one batch; every run gets it from `build`.

Lightning takes int(batches x fraction) of a split and refuses a fraction that comes to 0 ("0.1 * 3 < 1.
Please increase limit_val_batches"), once the data is set up: for the test split, after the whole fit.
A fraction asks for "a little of each split", and a tiny split's little is one batch: here the limit
becomes 1 before any loop reads it, said once. A split of unknown length (a stream) is left to Lightning.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from torch.utils.data import DistributedSampler

from hpctrain.runtime.namespaces import LightningPart, is_overridden

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.run")

SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


class BatchLimits(LightningPart, lightning="pytorch_lightning.Callback"):
    """Turns a `trainer.limit_<split>_batches` fraction that would select no batch of its split into 1."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.overfit_batches > 0:  # it sets the train and val limits itself
            return
        for split in SPLITS.get(stage, ()):
            key = f"limit_{split}_batches"
            fraction = getattr(trainer, key)
            if not isinstance(fraction, float) or not 0.0 < fraction < 1.0:
                continue
            batches = split_batches(trainer, pl_module, split)
            if batches is None or batches == 0 or int(batches * fraction) >= 1:
                continue
            setattr(trainer, key, 1)
            if trainer.is_global_zero:
                log.info(
                    "trainer.%s=%s of the %s split's %d batch(es) is less than one batch: 1 batch instead",
                    key,
                    fraction,
                    split,
                    batches,
                )


def split_batches(trainer: Trainer, pl_module: LightningModule, split: str) -> int | None:
    """The batches each process will get of `split` (the smallest of its loaders), from the hook Lightning
    calls for it (the datamodule's, else the module's); None when a loader has no length (a stream)."""
    hook = f"{split}_dataloader"
    owner = next(
        (o for o in (trainer.datamodule, pl_module) if o is not None and is_overridden(hook, o)), None
    )
    if owner is None:
        return None
    found = getattr(owner, hook)()
    if isinstance(found, dict):
        loaders = list(found.values())
    else:
        loaders = list(found) if isinstance(found, (list, tuple)) else [found]
    lengths = [_per_process(loader, trainer.world_size) for loader in loaders]
    return None if not lengths or None in lengths else min(n for n in lengths if n is not None)


def _per_process(loader: Any, processes: int) -> int | None:
    try:
        length = len(loader)
    except TypeError:
        return None
    # Lightning shares out a loader whose sampler is not distributed yet (the template's already is)
    if processes > 1 and not isinstance(getattr(loader, "sampler", None), DistributedSampler):
        return math.ceil(length / processes)
    return length
