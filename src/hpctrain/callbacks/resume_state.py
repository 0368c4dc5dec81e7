"""`ResumeState`: what hpctrain adds to every checkpoint (what and why:
`hpctrain.runtime.storage.checkpoints.resume_state`); every run gets it from `build`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.storage.checkpoints.reading import CONFIG_KEY
from hpctrain.runtime.storage.checkpoints.resume_state import (
    capture_metric_states,
    capture_rng_state,
    mid_epoch,
    restore_metric_states,
    restore_rng_state,
    resumes_mid_epoch,
)

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain.runtime.storage.checkpoints")


class ResumeState(LightningPart, lightning="pytorch_lightning.Callback"):
    """Adds each rank's RNG and (mid-epoch) metric states and the config to every checkpoint, and
    restores this rank's share when training starts, before the first resumed batch.

    Lightning builds the checkpoint on every rank (rank 0 writes it), so the per-rank states are
    gathered there with one collective. Metric states are restored only when the train dataloader
    resumes mid-epoch too (the template's loaders do; a plain DataLoader restarts the epoch, and its
    restored counts would include batches that are trained again).
    """

    @property
    def state_key(self) -> str:
        return "CheckpointExtras"  # its name until 0.4, under which every checkpoint keeps these states

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = config
        self._trainer: Trainer | None = None
        self._pending: dict[str, Any] | None = None  # the checkpoint's states, until fit starts
        self._state: dict[str, Any] | None = None  # this rank's share, until training starts
        self._fit_started = False

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.config is not None:
            checkpoint[CONFIG_KEY] = self.config

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning has read the checkpoint's callback states (load_state_dict) but not yet restored its
        # loops, and creates the first train iterator (which draws a plain DataLoader's shuffle seed
        # from the global RNG) before any later hook: every rank's random state comes back here.
        self._fit_started = True
        self._restore_own_share(trainer)
        # A per-step schedule reads `trainer.estimated_stepping_batches` in configure_optimizers, which
        # builds the train loader (and starts iterating it) before Lightning restores the checkpoint;
        # Lightning then keeps that loader and never gives it its saved position (Lightning #20550), so
        # a run resumed mid-epoch would re-read the epoch from its start. On resume, drop the early
        # loader here (after configure_optimizers, before the restore): fit builds it again and restores it.
        loop = trainer.fit_loop
        if trainer.ckpt_path is not None and loop._combined_loader is not None:
            if loop._data_fetcher is not None:
                loop._data_fetcher.teardown()  # ends worker processes the early iterator started
                loop._data_fetcher = None
            loop._combined_loader = None

    def _restore_own_share(self, trainer: Trainer) -> None:
        self._state = self._own_share(trainer)
        if self._state is not None:
            restore_rng_state(self._state["rng"])

    def _own_share(self, trainer: Trainer) -> dict[str, Any] | None:
        """This rank's saved states, once (None when not resuming, or resumed with another world size)."""
        if self._pending is None:
            return None
        per_rank, self._pending = self._pending.get("per_rank", []), None
        if len(per_rank) != trainer.world_size:  # resumed with another number of processes
            if per_rank and trainer.is_global_zero:
                log.warning(
                    "resumed on %d process(es) from a checkpoint saved by %d: weights and optimizer states are "
                    "restored whole, random states start from the seed, and a mid-epoch position goes on at the "
                    "same batch count per rank (the rest of that epoch may repeat or skip some samples)",
                    trainer.world_size,
                    len(per_rank),
                )
            return None
        return per_rank[trainer.global_rank]

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        state: dict[str, Any] = {"rng": capture_rng_state()}
        if trainer is not None and mid_epoch(trainer):
            state["metrics"] = capture_metric_states(trainer.lightning_module)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, state)
            return {"per_rank": gathered}
        return {"per_rank": [state]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict
        if self._fit_started and self._trainer is not None:
            # a strategy that restores after its setup (FSDP2: ModelParallelStrategy) reads the callback
            # states after on_fit_start, still before the first train iterator exists
            self._restore_own_share(self._trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_started = False
        # Under FSDP2 (restore_checkpoint_after_setup) Lightning restores the checkpoint after on_fit_start,
        # so the early loader above was kept (ckpt_path was not known yet) and its saved position, read
        # since, is never given to it: give it now, before the first resumed iterator is made.
        loop = trainer.fit_loop
        if loop._combined_loader_states_to_load and loop._combined_loader is not None:
            loop._combined_loader._load_state_dicts(loop._combined_loader_states_to_load)
            loop._combined_loader_states_to_load = []
        # After Lightning restored the checkpoint, before the first resumed batch is transferred (and
        # augmented: the transfer hooks run before on_train_batch_start).
        state, self._state = self._state, None
        if state is None or "metrics" not in state:
            return
        if resumes_mid_epoch(trainer.train_dataloader):
            restore_metric_states(pl_module, state["metrics"])
        elif trainer.is_global_zero:
            log.warning(
                "resumed mid-epoch with a train dataloader that cannot resume (%s has no state_dict): "
                "the rest of this epoch is drawn from its start again and its epoch metrics cover only "
                "the resumed steps; the template's loaders (hpctrain.data.loading.make_loader) resume exactly",
                type(trainer.train_dataloader).__name__,
            )
