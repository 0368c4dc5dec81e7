"""A loss that becomes NaN or infinite stops the run with one sentence (`nan.action=stop`).

Looking at the loss on the host every step would make a GPU wait for each step to finish (a host
sync per step). Instead, each step keeps a reference to its loss (still on its device, nothing is
copied or waited for), and the host looks at them all at once every `nan.check_every_n_steps` steps, before every
validation and when training ends: before any checkpoint of the non-finite weights is written, so
the newest checkpoint is the last good one. Rank 0 posts the sentence as a notification (`notify`: nan).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hpctrain.runtime.distributed import notify
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.storage.checkpoints import newest_checkpoint

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer


class NonFiniteLoss(LightningPart, lightning="pytorch_lightning.Callback"):
    def __init__(self, run_dir: str | Path, check_every_n_steps: int = 50) -> None:
        self.run_dir = Path(run_dir)
        self.every = max(1, int(check_every_n_steps))
        self._losses: list[Tensor] = []  # the losses since the last look, still on their device

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):
            return  # manual optimization returning nothing: no loss to look at
        self._losses.append(loss.detach())  # a reference, no copy and no wait
        if len(self._losses) >= self.every:
            self._check(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._check(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if not self._losses:
            return
        losses = torch.stack([loss.float().reshape(-1)[0] for loss in self._losses])
        self._losses = []
        bad = (~torch.isfinite(losses)).nonzero()  # the one host sync, every `every` steps
        if len(bad) == 0:
            return
        first = int(bad[0, 0])
        # the step as the module saw it (self.global_step in that training_step; one optimizer step per batch)
        step = trainer.global_step - len(losses) + first
        good = newest_checkpoint(self.run_dir)
        error = UserError(
            f"the training loss became {float(losses[first])} at step {step} (epoch {trainer.current_epoch}) "
            f"on rank {trainer.global_rank}; the last good checkpoint is {good or 'none: none was written before'}; "
            "lower the learning rate, clip gradients (trainer.gradient_clip_val=1.0) or look at that step's data, "
            "and resume with ckpt_path=<that checkpoint> or start again (nan.action=off keeps training)."
        )
        if trainer.global_rank == 0:
            notify.post(notify.NAN, str(error))
        raise error
