"""Callbacks the fine-tuning tests (tests/test_llm.py) add to a run of experiment=lora_sft: written with
`import lightning as L`, as its model is (one run's classes are of one Lightning package)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class GenerateAtStart(L.Callback):
    """The first call to the sharded model is a generation, on every rank, each rank stopping at another
    step (3 + 4 * rank new tokens, no end token): FSDP2 must gather the root for generate, and every rank
    must keep stepping until the last one is done. Writes <dir>/generated-<rank>.txt (the new tokens)."""

    def __init__(self, dir: str) -> None:
        self.dir = Path(dir)

    def on_train_start(self, trainer, pl_module):
        prompt = torch.tensor([[4, 20, 21, 22, 5]], device=pl_module.device)
        with torch.no_grad():
            out = pl_module.net.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=3 + 4 * trainer.global_rank,
                do_sample=False,
                use_cache=True,
                synced_gpus=trainer.world_size > 1,
                eos_token_id=None,
                pad_token_id=0,
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"generated-{trainer.global_rank}.txt").write_text(str(out.shape[1] - prompt.shape[1]))


class SaveBothAtStep(L.Callback):
    """At one step boundary, a checkpoint as the run stores them and one with everything (the frozen base
    too): the same state, the two ways (checkpoints.trainable_only=true and false); and one with everything
    when training ends."""

    def __init__(self, step: int, path: str, full_path: str, full_at_end: str) -> None:
        self.step, self.path, self.full_path, self.full_at_end = step, path, full_path, full_at_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self._save_whole(trainer, self.full_path)

    def on_train_end(self, trainer, pl_module):
        self._save_whole(trainer, self.full_at_end)

    def _save_whole(self, trainer, path: str) -> None:
        trainable = next(c for c in trainer.callbacks if type(c).__name__ == "TrainableOnly")
        trainable.active = False
        try:
            trainer.save_checkpoint(path)
        finally:
            trainable.active = True


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered: collective, every rank calls it), on the CPU."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach().cpu().clone()


class RecordSteps(L.Callback):
    """What a reference outside the template needs to replay a run: the trainable parameters at the start
    and after each optimizer step (`params-<step>.pt`, rank 0), each rank's training and sanity-check
    batches in order and the sanity check's val/loss (the model's metric, all ranks), at
    <dir>/rank<r>.pt."""

    def __init__(self, dir: str) -> None:
        self.dir = Path(dir)
        self.train: list[dict] = []
        self.val: list[dict] = []
        self.val_loss: float | None = None
        self.saved_step = -1

    def _save_params(self, trainer, pl_module) -> None:
        params = {n: _full(p) for n, p in pl_module.named_parameters() if p.requires_grad}
        if trainer.global_step != self.saved_step and trainer.is_global_zero:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.save(params, self.dir / f"params-{trainer.global_step}.pt")
        self.saved_step = trainer.global_step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            self.val.append({k: v.cpu() for k, v in batch.items()})

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:  # before the module's hook logs (and resets) it
            self.val_loss = float(pl_module.val_loss.compute())

    def on_train_start(self, trainer, pl_module):
        self._save_params(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.append({k: v.cpu() for k, v in batch.items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.saved_step:  # an optimizer step was taken
            self._save_params(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {"train": self.train, "val": self.val, "val_loss": self.val_loss}
        torch.save(record, self.dir / f"rank{trainer.global_rank}.pt")


IGNORED = ("python_dispatch.py", "llm_code.py", "eval_frame.py", "_compile.py")  # the counting itself


class CountHostReads(L.Callback):
    """Where the host reads a tensor's value (`.item()`, `float(t)`, `bool(t)`, a tensor passed where a
    number is expected: aten's _local_scalar_dense, what makes the host wait for a GPU), counted by the
    first line of the project's code below it, in training steps `first` to `last` - 1 (none of them a
    logging step) and in every validation step; written to `out` (JSON) when training ends."""

    def __init__(self, out: str, first: int = 2, last: int = 6) -> None:
        self.out, self.first, self.last = out, first, last
        self.places: dict[str, dict[str, int]] = {"train": {}, "val": {}}
        self._mode: object = None

    def _start(self, where: str) -> None:
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        places = self.places[where]

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    stack = [f for f in traceback.extract_stack() if not f.filename.endswith(IGNORED)]
                    place = f"{Path(stack[-1].filename).name}:{stack[-1].lineno}"
                    places[place] = places.get(place, 0) + 1
                return func(*args, **(kwargs or {}))

        self._mode = Count()
        self._mode.__enter__()

    def _stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first <= batch_idx < self.last:
            self._start("train")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._stop()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start("val")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._stop()

    def on_train_end(self, trainer, pl_module):
        import json

        self._stop()
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.places, indent=2))
