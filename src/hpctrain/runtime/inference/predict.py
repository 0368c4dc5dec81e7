"""Prediction with a trained model: every sample exactly once, on one process or many, in input order.

What is predicted, in this order of choice:
- `predict.input`: a file the datamodule reads itself where it has `predict_input(path, batch_size)` (a
  loader: the prompts of a language model's datamodule), else a folder of PNG/JPEG images (any depth,
  sorted by path; decoded as in `hpctrain.data.decode`) or a tensor file (`.pt` read with weights_only, or
  `.npy`) of uint8 images (N, C, H, W) with the checkpoint's `data.image_shape`;
- the datamodule's own `predict_dataloader`, if it has one (and `predict.split` was not given);
- the split `predict.split` (test, val or train), unshuffled.
Batches of an input look like a labelled split's (images, -1), so the datamodule's batch hooks (the
normalisation) treat them as in training.

Lightning shards a predict loader without padding (its UnrepeatedDistributedSamplerWrapper), so the
ranks may run different numbers of batches, which under FSDP2 (a forward is a collective) hangs: the
loaders made here shard themselves with padding instead (`in_order`), and Lightning records which samples
each batch holds. `PredictionWriter` keeps each rank's predictions with those indices,
writes them to `<run dir>/predictions/part-rank<N>.pt`, and rank 0 merges the parts by index into one
file, written atomically: a job stopped by a signal leaves no half-written output (under SLURM it is
requeued and predicts again). A module whose `predict_step` returns `{"class", "probs"}` (the template's
classifier) gets a CSV `index,path,class,prob_0..prob_{K-1}`; one that returns a list of JSON objects, one
a sample (a language model's generations), `predictions.jsonl`; any other gets `predictions.pt`
(`{"index": ..., "predictions": ...}`, loadable with weights_only=True).
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device  # namespace-free
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from hpctrain.data import decode
from hpctrain.data.loading import ResumableDataLoader, TensorDataset
from hpctrain.runtime.config.settings import Predict
from hpctrain.runtime.distributed.materialize import has_empty_parameters
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.inference.export import tensors
from hpctrain.runtime.namespaces import LightningPart, is_overridden, namespace_of
from hpctrain.runtime.storage.checkpoints import reading, trainable_only
from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO
from hpctrain.runtime.storage.records import write_atomically

if TYPE_CHECKING:
    from pytorch_lightning import LightningDataModule, LightningModule, Trainer

log = logging.getLogger("hpctrain")

SPLITS = {
    "train": ("fit", "train_dataloader"),
    "val": ("validate", "val_dataloader"),
    "test": ("test", "test_dataloader"),
}
PARTS_DIR = "predictions"
TENSOR_SUFFIXES = (".pt", ".pth", ".npy")


def predict(
    run: Any, checkpoint: Path, settings: Predict, run_dir: str | Path, split_given: bool
) -> Path | None:
    """Predict what `settings` chooses with the checkpoint's weights; returns the output file (rank 0)."""
    source, paths = choose_source(run.datamodule, settings, split_given)
    if run.trainer.is_global_zero:
        log.info("predicting %s", source)
    output = Path(settings.output).expanduser() if settings.output else None
    writer = namespace_of(run.trainer).part(PredictionWriter)(
        run_dir, output, paths
    )  # the trainer's namespace
    run.trainer.callbacks.append(writer)
    if has_empty_parameters(run.model):  # a base read once sharded (FSDP2): the weights loaded after it
        run.trainer.predict(run.model, run.datamodule, ckpt_path=checkpoint, return_predictions=False)
        return writer.written
    # The weights only (as trainer.predict(ckpt_path=...) would load), without Lightning's warning that
    # the training callbacks stored in the checkpoint are missing: prediction needs none of them.
    trainable_only.load_weights(run.model, reading.read(checkpoint), f"ckpt_path={checkpoint}")
    run.trainer.predict(run.model, run.datamodule, return_predictions=False)
    return writer.written


# ---------------------------------------------------------------------------------------------- sources


def choose_source(
    datamodule: LightningDataModule, settings: Predict, split_given: bool
) -> tuple[str, list[str] | None]:
    """Point the datamodule's `predict_dataloader` at what is to be predicted; returns its description and,
    for a folder of images, each sample's path."""
    batch_size = int(settings.batch_size or getattr(datamodule, "batch_size", None) or 64)
    read = getattr(datamodule, "predict_input", None)
    if settings.input and callable(read):  # a file of the datamodule's own kind
        given = read(Path(settings.input).expanduser(), batch_size)  # its loader, shared out here in order
        shared = (given.dataset, batch_size, 0, datamodule.trainer, given.collate_fn)
        _serve(datamodule, lambda: in_order(*shared))
        return f"{len(given.dataset)} samples of predict.input={settings.input}", None
    if settings.input:
        dataset, paths = input_dataset(Path(settings.input).expanduser(), _image_shape(datamodule))
        _serve(datamodule, lambda: in_order(dataset, batch_size, settings.num_workers, datamodule.trainer))
        return f"{len(dataset)} samples of predict.input={settings.input}", paths
    if is_overridden("predict_dataloader", datamodule) and not split_given:
        return f"the datamodule's predict_dataloader ({type(datamodule).__name__})", None
    split = settings.split
    stage, hook = SPLITS[split]
    if not is_overridden(hook, datamodule):
        raise UserError(
            f"predict.split={split}, but {type(datamodule).__name__} has no {hook}; choose another split."
        )

    def split_loader() -> Any:
        datamodule.setup(stage)  # a datamodule written as in Lightning's docs sets a split up for its stage
        loader = getattr(datamodule, hook)()
        if not isinstance(loader, ResumableDataLoader):
            return loader
        return in_order(loader.dataset, loader.sampler.batch_size, settings.num_workers, datamodule.trainer)

    _serve(datamodule, split_loader)
    return f"the {split} split", None


def _serve(datamodule: LightningDataModule, make_loader: Callable[[], Any]) -> None:
    # On the datamodule itself rather than a loader passed to trainer.predict: its batch hooks (the
    # normalisation on the device, in the template's datamodules) must run on these batches too.
    datamodule.predict_dataloader = make_loader  # type: ignore[method-assign]


def in_order(
    dataset: Any, batch_size: int, workers: int, trainer: Trainer | None, collate: Any = None
) -> DataLoader:
    """The samples in their order, each rank its share, padded with the first samples again so that
    every rank runs as many batches (the writer keeps each sample once)."""
    shares = trainer.distributed_sampler_kwargs if trainer is not None else None
    sampler = DistributedSampler(dataset, shuffle=False, **shares) if shares else None
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, collate_fn=collate
    )


def _image_shape(datamodule: LightningDataModule) -> tuple[int, ...]:
    shape = getattr(datamodule, "image_shape", None)
    if not shape:
        raise UserError(
            f"predict.input needs the image shape the model takes, but {type(datamodule).__name__} has no "
            "image_shape; give the datamodule one, or predict with its own predict_dataloader."
        )
    return tuple(int(d) for d in shape)


def input_dataset(path: Path, image_shape: Sequence[int]) -> tuple[Any, list[str] | None]:
    """A folder of image files, or a file of uint8 images (see the module docstring)."""
    if path.is_dir():
        files = decode.image_files(path)
        decode.check_headers(files)
        dataset = decode.ImageFiles(files, image_shape, root=path)
        return dataset, dataset.paths
    images = read_tensor_file(path, image_shape)
    return TensorDataset(images, torch.full((len(images),), -1, dtype=torch.int64)), None


def read_tensor_file(path: Path, image_shape: Sequence[int]) -> Tensor:
    if not path.is_file():
        raise UserError(f"predict.input={path} does not exist; pass a folder of images or a .pt/.npy file.")
    if path.suffix not in TENSOR_SUFFIXES:
        raise UserError(
            f"predict.input={path} is neither a folder of images nor a tensor file ({', '.join(TENSOR_SUFFIXES)})."
        )
    try:
        if path.suffix == ".npy":
            images = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            images = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = " ".join(str(err).split())[:160] or type(err).__name__
        raise UserError(f"predict.input={path} cannot be read ({reason}).") from err
    expected = [int(d) for d in image_shape]
    if not (
        isinstance(images, Tensor)
        and images.dtype == torch.uint8
        and images.dim() == 4
        and list(images.shape[1:]) == expected
    ):
        found = (
            f"{images.dtype} {list(images.shape)}" if isinstance(images, Tensor) else type(images).__name__
        )
        raise UserError(
            f"predict.input={path} holds {found}; it must be uint8 images (N, {', '.join(map(str, expected))}) as the "
            "model was trained on."
        )
    return images


# ---------------------------------------------------------------------------------------------- writing


class PredictionWriter(LightningPart, lightning="pytorch_lightning.callbacks.BasePredictionWriter"):
    """Keeps this rank's predictions with their sample indices; at the end, rank 0 merges every rank's
    part into one output in input order (see the module docstring)."""

    def __init__(self, run_dir: str | Path, output: Path | None, paths: list[str] | None = None) -> None:
        super().__init__(write_interval="batch")
        self.parts_dir = Path(run_dir) / PARTS_DIR
        self.output = output
        self.paths = paths
        self.written: Path | None = None
        self._indices: list[Tensor] = []
        self._outputs: list[Any] = []

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._indices, self._outputs = [], []
        loaders = trainer.predict_dataloaders
        if isinstance(loaders, (list, tuple)) and len(loaders) != 1:
            raise UserError(
                f"the datamodule's predict_dataloader returns {len(loaders)} loaders; src/predict.py writes one output, "
                "so return one loader (or predict each in a run of its own)."
            )

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if prediction is None:
            raise UserError(
                f"{type(pl_module).__name__}.predict_step returned None; return the predictions (tensors with one "
                "row per sample, or dicts, lists or tuples of them)."
            )
        prediction = move_data_to_device(
            apply_to_collection(prediction, Tensor, Tensor.detach), torch.device("cpu")
        )
        rows = _rows(prediction)
        if batch_indices:
            indices = torch.as_tensor(list(batch_indices), dtype=torch.int64)
        elif trainer.world_size == 1:  # a loader without indices (an iterable stream): its order is the order
            done = sum(len(i) for i in self._indices)
            indices = torch.arange(done, done + rows)
        else:
            raise UserError(
                "the predict loader does not say which samples each batch holds (an iterable dataset), so predictions "
                "of several processes cannot be put in input order; predict on one process, or from a map-style dataset."
            )
        if rows != len(indices):
            raise UserError(
                f"{type(pl_module).__name__}.predict_step returned {rows} rows for a batch of {len(indices)} samples; "
                "return one row per sample so predictions can be written in input order."
            )
        self._indices.append(indices)
        self._outputs.append(prediction)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        part = self.parts_dir / f"part-rank{trainer.global_rank}.pt"
        empty = {"index": torch.zeros(0, dtype=torch.int64), "predictions": None}
        content = (
            {"index": torch.cat(self._indices), "predictions": _cat(self._outputs)}
            if self._indices
            else empty
        )
        _save_atomically(content, part)
        trainer.strategy.barrier("prediction_parts")
        if trainer.is_global_zero:
            self.written = self._merge(trainer.world_size)
        trainer.strategy.barrier("predictions_merged")

    def _merge(self, world_size: int) -> Path:
        parts = [self.parts_dir / f"part-rank{rank}.pt" for rank in range(world_size)]
        contents = [torch.load(p, map_location="cpu", weights_only=True) for p in parts]
        contents = [c for c in contents if c["predictions"] is not None]
        if not contents:
            raise UserError("there was nothing to predict: the predict loader yielded no batch.")
        index = torch.cat([c["index"] for c in contents])
        predictions = _cat([c["predictions"] for c in contents])
        order = torch.argsort(index, stable=True)
        index = index[order]
        keep = torch.ones(len(index), dtype=torch.bool)
        keep[1:] = index[1:] != index[:-1]  # a sample predicted twice (a padding sampler of the user's): once
        order = order[keep]
        index, predictions = index[keep], apply_to_collection(predictions, Tensor, lambda t: t[order])
        records = _is_records(predictions)
        if records:
            predictions = [predictions[i] for i in order.tolist()]
        classifier = _is_classification(predictions)
        kind = "csv" if classifier else "jsonl" if records else "pt"
        output = self.output or self.parts_dir.parent / f"predictions.{kind}"
        if records and output.suffix != ".pt":
            lines = (
                json.dumps({"index": i, **r}) + "\n" for i, r in zip(index.tolist(), predictions, strict=True)
            )
            write_atomically(output, "".join(lines))
        elif classifier and output.suffix != ".pt":
            _write_csv(output, index, predictions, self.paths)
        else:
            _save_atomically({"index": index, "predictions": predictions}, output)
        for p in parts:
            p.unlink(missing_ok=True)
        if not any(self.parts_dir.iterdir()):
            self.parts_dir.rmdir()
        log.info("predictions of %d samples: %s", len(index), output)
        return output


def _rows(prediction: Any) -> int:
    """The number of samples a prediction covers: the first dimension every tensor in it shares (or the
    length of a list of JSON objects)."""
    if _is_records(prediction):
        return len(prediction)
    leaves = tensors(prediction)
    sizes = {len(t) if isinstance(t, Tensor) and t.dim() > 0 else None for t in leaves}
    if len(sizes) != 1 or None in sizes:
        kinds = sorted(
            {f"{type(t).__name__}{list(t.shape) if isinstance(t, Tensor) else ''}" for t in leaves}
        )
        raise UserError(
            f"predict_step returned {', '.join(kinds)}; return tensors with one row per sample (or dicts, lists or "
            "tuples of them) so that predictions can be written in input order."
        )
    return sizes.pop()


def _is_records(predictions: Any) -> bool:
    return isinstance(predictions, list) and all(isinstance(p, dict) for p in predictions)


def _cat(items: list[Any]) -> Any:
    first = items[0]
    if _is_records(first):
        return [record for item in items for record in item]
    if isinstance(first, Tensor):
        return torch.cat(items)
    if isinstance(first, dict):
        return {k: _cat([i[k] for i in items]) for k in first}
    return type(first)(_cat(list(parts)) for parts in zip(*items, strict=True))


def _is_classification(predictions: Any) -> bool:
    return (
        isinstance(predictions, dict)
        and set(predictions) == {"class", "probs"}
        and predictions["probs"].dim() == 2
    )


def _write_csv(output: Path, index: Tensor, predictions: dict[str, Tensor], paths: list[str] | None) -> None:
    classes, probs = predictions["class"].tolist(), predictions["probs"].float().tolist()
    header = ["index", "path", "class", *(f"prob_{k}" for k in range(len(probs[0]) if probs else 0))]
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(header)
    for i, c, p in zip(index.tolist(), classes, probs, strict=True):
        writer.writerow([i, paths[i] if paths else "", c, *(f"{x:.6g}" for x in p)])
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(output, text.getvalue())


def _save_atomically(content: Any, path: Path) -> None:
    AtomicCheckpointIO().save_checkpoint(content, path)  # temporary file beside it, fsync, rename
