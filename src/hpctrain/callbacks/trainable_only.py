"""`TrainableOnly`: `checkpoints.trainable_only` (what and why: `hpctrain.runtime.storage.checkpoints.trainable_only`);
every run gets it from `build`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.storage.checkpoints import trainable_only
from hpctrain.runtime.storage.checkpoints.sharded import META_FILE

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.storage.checkpoints")


class TrainableOnly(LightningPart, lightning="pytorch_lightning.Callback"):
    """With `setting` true (or auto, where most parameters are frozen and the module reads them from their
    files, `pretrained_files()`), the module's state dict leaves its
    frozen parameters out for the whole run, so every checkpoint stores the trainable part only, with the
    frozen part's fingerprint; a checkpoint loaded at resume is checked against the base built now. A run
    resumed from a trainable-only checkpoint stores trainable-only checkpoints too, whatever the setting."""

    def __init__(self, setting: bool | str = "auto") -> None:
        self.setting = setting
        self.active = False
        self._handles: list[Any] = []
        self._fingerprint: dict[str, Any] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        frozen = trainable_only.frozen_names(pl_module)
        if not frozen:
            return
        resumed = _marked(trainer.ckpt_path)
        if self.setting is True and not callable(getattr(pl_module, "pretrained_files", None)):
            raise UserError(
                f"checkpoints.trainable_only=true, but {type(pl_module).__name__} does not read its frozen parameters "
                "from files (pretrained_files()), so a checkpoint without them could be neither resumed nor "
                "evaluated; pass checkpoints.trainable_only=auto to store them."
            )
        self.active = (
            self.setting is True
            or (self.setting == "auto" and trainable_only.rebuilt_from_source(pl_module))
            or resumed
        )
        # a checkpoint without the frozen parameters loads over the base the model built (both ways)
        self._handles.append(
            pl_module.register_load_state_dict_post_hook(trainable_only.frozen_may_be_missing(pl_module))
        )
        if not self.active:
            return
        # the frozen part is the base built now, in no file: a file loads under FSDP2 without it too
        pl_module.strict_loading = False
        self._handles.append(pl_module.register_state_dict_post_hook(self._without_frozen(pl_module)))
        if trainer.is_global_zero:
            log.info(
                "checkpoints: the trainable parameters only (%s; checkpoints.trainable_only=%s%s); the "
                "%d frozen ones are rebuilt from their source on resume",
                trainable_only.size_note(pl_module),
                self.setting,
                ", as the checkpoint resumed from" if resumed and self.setting is not True else "",
                len(frozen),
            )

    def _without_frozen(self, module: LightningModule) -> Any:
        leave_out = trainable_only.without_frozen(module)

        def hook(*args: Any) -> None:
            if self.active:  # read at each save: the state dict of a run that stores everything is whole
                leave_out(*args)

        return hook

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.active:
            return
        if self._fingerprint is None:  # the frozen part does not change: measured at the first save only
            self._fingerprint = trainable_only.fingerprint(pl_module)
        checkpoint[trainable_only.FROZEN_KEY] = self._fingerprint

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        found = trainable_only.stored(checkpoint)
        if found is not None:
            trainable_only.check_same_base(found, pl_module, f"ckpt_path={trainer.ckpt_path}")


def _marked(path: Any) -> bool:
    """Whether the checkpoint a run starts from stores trainable parameters only."""
    if not path:
        return False
    path = Path(path)
    try:
        file = path / META_FILE if path.is_dir() else path
        content = torch.load(file, map_location="cpu", weights_only=True, mmap=not path.is_dir())
    except Exception:  # an unreadable checkpoint is Lightning's to report, when it loads it
        return False
    return isinstance(content, dict) and trainable_only.stored(content) is not None
