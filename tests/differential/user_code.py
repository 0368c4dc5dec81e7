"""User code written the way Lightning's documentation writes it: nothing here knows the template.

Every module, datamodule and callback below is trained twice by tests/test_differential.py, once by a
plain `pl.Trainer` script (tests/differential/bare.py) and once by `python src/train.py`. What a user
observes is recorded the same way on both sides: `count()` notes a hook call, and `Recorder` writes
the counts of each rank to $DIFF_OUT/hooks-rank<R>.json whenever a stage ends.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, default_collate
from torchmetrics import MaxMetric, MeanMetric

COUNTS: Counter[str] = Counter()
NOTES: dict[str, object] = {}


def count(name: str) -> None:
    COUNTS[name] += 1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _package(obj: object) -> str:
    """The Lightning package an object's class comes from: `pytorch_lightning` (with lightning_fabric) or
    `lightning` (lightning.pytorch, lightning.fabric)."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(("pytorch_lightning", "lightning_fabric")):
            return "pytorch_lightning"
        if cls.__module__.startswith("lightning."):
            return "lightning"
    return "neither"


class Recorder(Callback):
    """The harness's probe (on both sides): hook counts, custom notes, where training ended, and which
    Lightning package the Trainer and everything it runs with come from (the same as this file's)."""

    def on_fit_start(self, trainer, pl_module):
        strategy = trainer.strategy
        parts = [trainer, strategy, getattr(strategy, "cluster_environment", None), strategy.checkpoint_io]
        parts += [pl_module, trainer.datamodule, *trainer.callbacks, *trainer.loggers]
        NOTES["packages"] = sorted({_package(part) for part in parts if part is not None})

    def on_train_epoch_end(self, trainer, pl_module):
        NOTES["last_epoch_end"] = [trainer.current_epoch, trainer.global_step]

    def teardown(self, trainer, pl_module, stage):
        out = os.environ.get("DIFF_OUT")
        if out:
            record = {"counts": dict(COUNTS), "notes": NOTES}
            Path(out, f"hooks-rank{_rank()}.json").write_text(json.dumps(record, sort_keys=True))


# ------------------------------------------------------------------------------------------ data


def _digits(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.images, dtype=torch.float32).view(-1, 64) / 16.0
    y = torch.as_tensor(digits.target)
    return (x[:n], y[:n]) if n else (x, y)


class DigitsData(pl.LightningDataModule):
    """scikit-learn's digits as flat vectors: 640 to train, 160 to validate, 160 to test."""

    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        x, y = _digits(960)
        self.train_set = TensorDataset(x[:640], y[:640])
        self.val_set = TensorDataset(x[640:800], y[640:800])
        self.test_set = TensorDataset(x[800:], y[800:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)


class PredictData(DigitsData):
    """Has a predict_dataloader: the first 161 digits, unlabelled (an odd count, so padding would show)."""

    def predict_dataloader(self):
        x, _ = _digits(161)
        return DataLoader(TensorDataset(x), batch_size=self.batch_size)


class DigitStream(IterableDataset):
    """The training digits as a stream, as one would read records from files."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(len(self.y)):
            yield self.x[i], self.y[i]


class StreamData(DigitsData):
    """The training set as an IterableDataset, shared out across ranks with the template's helper."""

    def train_dataloader(self):
        from hpctrain.data.iterable import ShardedIterable

        return DataLoader(ShardedIterable(DigitStream(*self.train_set.tensors)), batch_size=self.batch_size)


class UnshardedStreamData(DigitsData):
    """The training set as a stream that does not share itself out: every rank would read all of it."""

    def train_dataloader(self):
        return DataLoader(DigitStream(*self.train_set.tensors), batch_size=self.batch_size)


class UnevenStream(IterableDataset):
    """A stream shared out by hand, unevenly: rank r reads 320 + 64 r samples (10 + 2 r batches of 32)."""

    shards_across_ranks = True

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        rank = _rank()
        for i in range(320 + 64 * rank):
            yield self.x[i % len(self.x)], self.y[i % len(self.y)]


class UnevenStreamData(DigitsData):
    def train_dataloader(self):
        return DataLoader(UnevenStream(*self.train_set.tensors), batch_size=self.batch_size)


class TwoValSetsData(DigitsData):
    """Two validation sets: the validation digits, and the same digits mirrored left to right."""

    def val_dataloader(self):
        x, y = self.val_set.tensors
        mirrored = x.view(-1, 8, 8).flip(-1).reshape(-1, 64)
        return [
            DataLoader(self.val_set, batch_size=self.batch_size),
            DataLoader(TensorDataset(mirrored, y), batch_size=self.batch_size),
        ]


class ResumableData(DigitsData):
    """The training set through the template's resumable loader (hpctrain.data.loading.make_loader), which
    Lightning restores mid-epoch: the documented way to resume exactly with your own datamodule."""

    def train_dataloader(self):
        from hpctrain.data.loading import TensorDataset as IndexableTensors
        from hpctrain.data.loading import make_loader

        x, y = self.train_set.tensors
        return make_loader(IndexableTensors(x, y), self.batch_size, shuffle=True, seed=0)


class SlowLoaderData(DigitsData):
    """Its training loader takes `sleep_s` per batch, as a slow disk or a decoder without workers does."""

    def __init__(self, batch_size: int = 32, sleep_s: float = 0.0):
        super().__init__(batch_size)
        self.sleep_s = sleep_s

    def train_dataloader(self):
        def collate(samples):
            time.sleep(self.sleep_s)
            return default_collate(samples)

        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=collate)


# ----------------------------------------------------------------------------------------- modules


class LitClassifier(pl.LightningModule):
    """A small classifier that logs train_loss, val_loss, val_acc and test_acc."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class PeaksEarly(LitClassifier):
    """Its validation accuracy peaks at epoch `peak_epoch` and falls after it (from then on each step climbs
    the loss, as a learning rate gone wrong would). It keeps its best validation accuracy as torchmetrics'
    docs show: a MaxMetric, persistent, so that checkpoints hold it, logged as val_acc_best."""

    def __init__(self, lr: float = 0.05, peak_epoch: int = 1):
        super().__init__(lr)
        self.peak_epoch = peak_epoch
        self.val_acc = MeanMetric()
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss if self.current_epoch <= self.peak_epoch else -loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.val_acc.update((logits.argmax(1) == y).float().mean(), len(y))

    def on_validation_epoch_end(self):
        acc = self.val_acc.compute()
        self.val_acc.reset()
        if not self.trainer.sanity_checking:
            self.val_acc_best.update(acc)
        self.log("val_acc", acc)
        self.log("val_acc_best", acc if self.trainer.sanity_checking else self.val_acc_best.compute())


class WideClassifier(LitClassifier):
    """LitClassifier with two hidden layers of `hidden` units (a larger model, for memory figures)."""

    def __init__(self, lr: float = 0.05, hidden: int = 32):
        super().__init__(lr)
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )


class PredictingClassifier(LitClassifier):
    """Has its own predict_step: the probabilities of each class. With $SLOW_PREDICT set, each batch takes
    that many seconds and says so (a test signals the job mid-prediction)."""

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        if os.environ.get("SLOW_PREDICT"):
            time.sleep(float(os.environ["SLOW_PREDICT"]))
            print(f"predict batch {batch_idx}", flush=True)
        return self(x).softmax(dim=-1)


class NaNAtStep(LitClassifier):
    """Its loss becomes NaN at step $NAN_AT_STEP (as a learning rate far too high would make it)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == int(os.environ["NAN_AT_STEP"]) else loss


class SleepyRank(LitClassifier):
    """Rank $SLEEP_RANK sleeps $SLEEP_S seconds in its training_step at step $SLEEP_AT_STEP (a rank stuck
    before a collective: the others wait for it in the backward pass's all-reduce), or with
    $SLEEP_IN=sanity_check in the sanity check's validation_step at that batch, after touching $SLEEP_MARK
    so that a test knows it is asleep."""

    def _asleep_at(self, loop, at):
        return (
            os.environ.get("SLEEP_IN", "train") == loop
            and self.global_rank == int(os.environ["SLEEP_RANK"])
            and at == int(os.environ["SLEEP_AT_STEP"])
        )

    def training_step(self, batch, batch_idx):
        if self._asleep_at("train", self.global_step):
            Path(os.environ["SLEEP_MARK"]).touch()
            time.sleep(float(os.environ["SLEEP_S"]))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self._asleep_at("sanity_check" if self.trainer.sanity_checking else "validate", batch_idx):
            Path(os.environ["SLEEP_MARK"]).touch()
            time.sleep(float(os.environ["SLEEP_S"]))  # in validation
        return super().validation_step(batch, batch_idx)


class SlowRankCallback(Callback):
    """A callback that makes rank $SLOW_RANK sleep $SLOW_S seconds at the start of every training step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == int(os.environ["SLOW_RANK"]):
            time.sleep(float(os.environ["SLOW_S"]))


class SelfShardingClassifier(LitClassifier):
    """Shards itself in configure_model, as Lightning's ModelParallelStrategy docs write it."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.net, FSDPModule):  # called for fit and again for test: once is enough
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class DumpLoadedState(Callback):
    """Rank 0 saves, as training starts (after a checkpoint was loaded), the whole model's weights and
    optimizer states, gathered from every rank's shard (FSDP2), to `path`: what the run resumed with."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(pl_module, options=options)
        optimizer = get_optimizer_state_dict(pl_module, trainer.optimizers[0], options=options)
        if trainer.global_rank == 0:
            flat = {f"state_dict.{k}": v for k, v in weights.items()}
            for name, states in optimizer["state"].items():
                flat.update({f"optimizer_0.state.{name}.{k}": v for k, v in states.items()})
            torch.save(flat, self.path)


class KillRankAtSave(Callback):
    """Rank `rank` dies (SIGKILL) in the middle of the checkpoint of step `step`: right after it wrote its
    shard, before the checkpoint's index is (FSDP2); a plain checkpoint's rank dies as the save begins."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        from torch.distributed.checkpoint import FileSystemWriter

        if type(trainer.strategy).__name__ != "HydraModelParallelStrategy":
            os.kill(os.getpid(), 9)
        written = FileSystemWriter.write_data

        def write_then_die(writer, plan, planner):
            result = written(writer, plan, planner)
            result.wait()  # this rank's shard is on disk
            os.kill(os.getpid(), 9)

        FileSystemWriter.write_data = write_then_die


class ValLossOnly(LitClassifier):
    """Logs nothing during training: only val_loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


class SyncDistClassifier(LitClassifier):
    """Logs its validation metrics with sync_dist=True (averaged over ranks)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)


class PlateauClassifier(LitClassifier):
    """configure_optimizers returns a dict with ReduceLROnPlateau watching val_loss."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    def on_train_epoch_end(self):
        self.log("lr", self.optimizers().param_groups[0]["lr"])


class OneCycleClassifier(LitClassifier):
    """A per-step OneCycleLR whose length is the trainer's estimate, as Lightning's docs suggest."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class WithOwnCallbacks(LitClassifier):
    """configure_callbacks adds a callback; setup appends another once the Trainer exists."""

    def configure_callbacks(self):
        return [CountingCallback("configured")]

    def setup(self, stage):
        if stage == "fit":
            self.trainer.callbacks.append(CountingCallback("appended"))


class StatefulClassifier(LitClassifier):
    """Keeps its own state in checkpoints (on_save_checkpoint / on_load_checkpoint)."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr)
        self.epochs_seen = 0

    def on_train_epoch_end(self):
        self.epochs_seen += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["epochs_seen"] = self.epochs_seen

    def on_load_checkpoint(self, checkpoint):
        self.epochs_seen = checkpoint["epochs_seen"]
        NOTES.setdefault("loaded_epochs_seen", []).append(self.epochs_seen)  # fit's resume, then test's

    def on_fit_end(self):
        NOTES["epochs_seen"] = self.epochs_seen


class TwoValSetsClassifier(LitClassifier):
    """Validates on each of several validation sets: Lightning suffixes each name, val_loss/dataloader_idx_N."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


class SimpleDenseNet(nn.Module):
    """A network given to the LightningModule as an argument, as lightning-hydra-template's configs do."""

    def __init__(self, input_size: int = 64, hidden: int = 32, output_size: int = 10):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(input_size, hidden), nn.ReLU(), nn.Linear(hidden, output_size))

    def forward(self, x):
        return self.model(x)


class NetInHparamsClassifier(pl.LightningModule):
    """Written as lightning-hydra-template writes its modules: the network and a partial optimizer and
    scheduler are arguments, and save_hyperparameters() keeps all of them (the network too)."""

    def __init__(self, net: nn.Module, optimizer, scheduler=None, compile: bool = False):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/acc", (self(x).argmax(1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).softmax(dim=-1)

    def configure_optimizers(self):
        optimizer = self.hparams.optimizer(params=self.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}


class TwoOptimizerGAN(pl.LightningModule):
    """Manual optimization with two optimizers, as Lightning's GAN example: the generator's step leaves
    the discriminator's parameters without a gradient and the other way round."""

    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64))
        self.discriminator = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        g_opt, d_opt = self.optimizers()
        noise = torch.randn(len(real), 8, device=real.device)
        fake = self.generator(noise)
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

        d_real = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_fake = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_loss = (d_real + d_fake) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def validation_step(self, batch, batch_idx):
        real, _ = batch
        self.log(
            "val_loss", F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(len(real), 1))
        )

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=self.lr),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr),
        )


# ---------------------------------------------------------------------------------------- callbacks


class CountingCallback(Callback):
    """Counts the hooks it implements, under its label."""

    def __init__(self, label: str = "counting"):
        self.label = label

    def on_train_epoch_end(self, trainer, pl_module):
        count(f"{self.label}.on_train_epoch_end")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        count(f"{self.label}.on_train_batch_end")

    def on_validation_end(self, trainer, pl_module):
        count(f"{self.label}.on_validation_end")


class EpochCounter(Callback):
    """A stateful callback: the epochs it saw, kept in checkpoints through state_dict / load_state_dict."""

    def __init__(self):
        self.epochs = 0

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs += 1

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state_dict):
        self.epochs = state_dict["epochs"]
        NOTES.setdefault("callback_loaded_epochs", []).append(self.epochs)

    def on_fit_end(self, trainer, pl_module):
        NOTES["callback_epochs"] = self.epochs


def epoch_ended(trainer, pl_module):
    """A hook for LambdaCallback(on_train_epoch_end=...)."""
    count("lambda.on_train_epoch_end")


def batch_ended(trainer, pl_module, outputs, batch, batch_idx):
    """A hook for LambdaCallback(on_train_batch_end=...)."""
    count("lambda.on_train_batch_end")


class SaveAtStep(Callback):
    """Saves a checkpoint at one step boundary inside fit (as a preemption would), then goes on."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class PredictOnRankZero(Callback):
    """A plot or a sample the way one writes it under DDP: the model run on rank 0 only, at the end of each
    validation (the sanity check's included). Under FSDP2 that forward waits for the other ranks."""

    def on_validation_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            with torch.no_grad():
                pl_module(torch.zeros(2, 64, device=pl_module.device))


class HangOnRankZero(Callback):
    """Rank 0 waits forever at the end of the sanity check, after touching $HANG_MARK (a hung callback: the
    other ranks wait for it in their next collective). Signal handlers run; nothing they record is acted on."""

    def on_sanity_check_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(os.environ["HANG_MARK"]).touch()
            import threading

            threading.Event().wait()


class CountGradientReduces(Callback):
    """Counts the gradient reductions (torch.distributed.reduce_scatter_single, FSDP2's) issued during each
    training batch, and writes rank 0's list to `path` at the end of fit."""

    def __init__(self, path: str):
        self.path, self.per_batch, self._calls, self._before = path, [], [0], 0

    def on_train_start(self, trainer, pl_module):
        import torch.distributed as dist

        original = self._original = dist.reduce_scatter_single

        def counted(*args, **kwargs):
            self._calls[0] += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = self._calls[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_batch.append(self._calls[0] - self._before)

    def on_train_end(self, trainer, pl_module):
        import torch.distributed as dist

        dist.reduce_scatter_single = self._original
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.per_batch))
