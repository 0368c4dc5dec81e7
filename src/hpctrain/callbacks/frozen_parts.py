"""`FrozenParts`: `init_from.freeze` and `init_from.unfreeze_at_epoch` (added by `build`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain")


class FrozenParts(LightningPart, lightning="pytorch_lightning.Callback"):
    """Parameters matching `patterns` are not trained; BatchNorm layers whose parameters are all frozen
    are in eval mode while frozen, so their running statistics stay as loaded.

    Without `unfreeze_at_epoch` they get no gradient at all (requires_grad=False: the backward pass skips
    them). With it they are frozen by dropping their gradients before each optimizer step until that
    epoch, then trained like the rest. `requires_grad` never changes while training: DDP builds its
    gradient buckets once, when it wraps the model, and a parameter switched on later would not be
    synchronised across ranks (Lightning #20340); a dropped gradient is skipped by every torch optimizer
    (no update, no weight decay, no momentum), on every rank alike.
    """

    def __init__(
        self, module: nn.Module, patterns: Sequence[str], unfreeze_at_epoch: int | None = None
    ) -> None:
        self.patterns = list(patterns)
        self.unfreeze_at_epoch = unfreeze_at_epoch
        named = dict(module.named_parameters())
        frozen = [name for name in named if any(re.search(r, name) for r in self.patterns)]
        if not frozen:
            raise UserError(
                f"init_from.freeze={self.patterns} matches no parameter of the model; the names look like "
                f"{', '.join(list(named)[:3])}."
            )
        self.frozen = frozen
        self._parameters = [named[name] for name in frozen]
        if unfreeze_at_epoch is None:
            for parameter in self._parameters:
                parameter.requires_grad_(False)
        chosen = set(frozen)
        self.norms = [
            name
            for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and any(True for _ in m.parameters(recurse=False))
            and all(f"{name}.{p}" in chosen for p, _ in m.named_parameters(recurse=False))
        ]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The parameters by their names again: a sharded strategy (FSDP2) replaced them when it sharded the
        # model (configure_model), and a gradient dropped on a parameter the model no longer has frees nothing.
        named = dict(pl_module.named_parameters())
        self._parameters = [named[name] for name in self.frozen]

    def _frozen_now(self, trainer: Trainer) -> bool:
        return self.unfreeze_at_epoch is None or trainer.current_epoch < self.unfreeze_at_epoch

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning keeps each module's mode across validation, so a BatchNorm layer put in eval mode
        # stays there until it is put back in train mode here, on unfreezing.
        frozen = self._frozen_now(trainer)
        modules = dict(pl_module.named_modules())
        for name in self.norms:
            modules[name].train(not frozen)
        if not frozen and trainer.current_epoch == self.unfreeze_at_epoch and trainer.is_global_zero:
            log.info(
                "init_from: %d frozen parameters are trained from epoch %d on",
                len(self.frozen),
                trainer.current_epoch,
            )

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.unfreeze_at_epoch is not None and self._frozen_now(trainer):
            for parameter in self._parameters:
                parameter.grad = None
