"""A callback that shows what a language model writes: a short sample after each validation."""

from __future__ import annotations

import logging

import torch
from pytorch_lightning import Callback, LightningModule, Trainer

log = logging.getLogger(__package__.split(".")[0])


class TextSample(Callback):
    """Log `length` bytes generated from `prompt` after every validation (not the sanity check).

    Every rank generates, and rank 0 logs: under a sharded strategy (FSDP2, tensor parallelism) a forward
    gathers parameters from every rank, so a model run on one rank alone would wait for the others
    forever. The draws come from a generator seeded by the epoch, so every rank samples the same text,
    the training's random state is left as it was, and a run resumed from a checkpoint writes exactly
    what the uninterrupted run writes.
    """

    def __init__(
        self, prompt: str = "def ", length: int = 200, temperature: float = 0.8, top_k: int | None = 40
    ) -> None:
        self.prompt, self.length, self.temperature, self.top_k = prompt, length, temperature, top_k
        self.last: str | None = None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        net = pl_module.net
        was_training = net.training
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(trainer.current_epoch)  # the same draws on every rank
            net.eval()
            start = torch.tensor([list(self.prompt.encode())], device=pl_module.device)
            out = net.generate(start, self.length, temperature=self.temperature, top_k=self.top_k)
        net.train(was_training)
        self.last = bytes(out[0].tolist()).decode(errors="replace")
        if trainer.is_global_zero:
            log.info("sample after epoch %d:\n%s", trainer.current_epoch, self.last)
