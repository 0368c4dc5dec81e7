"""Writes one line per finished training epoch to a file."""

from pathlib import Path

from hpctrain.runtime.namespaces import LightningPart


class EpochMarks(LightningPart, lightning="pytorch_lightning.Callback"):  # a Callback of the run's package
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with self.path.open("a") as out:
                out.write(f"epoch {trainer.current_epoch}\n")
