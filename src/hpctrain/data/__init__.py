"""hpctrain's data machinery, and the names your datamodules use (the public API, versioned with hpctrain).

    from hpctrain.data import ImageDataModule, TensorDataset, split, make_loader

- Base classes: `ImageDataModule` (uint8 images in memory, sharded across ranks, resumable, normalised
  on the device), `DownloadedImageDataModule`, `FileImageDataModule`, `ImageFolderDataModule` (a folder
  of PNG/JPEG files), `ShardsDataModule` (the same packed into shards, staged per node).
- Loading: `TensorDataset`, `make_loader` and `ResumableDataLoader` (exact mid-epoch resume),
  `pin_memory_default`, `tensors_to_device`, `split`.
- Staging: `stage_folder` (a node-local copy of a folder, such as a pretrained model's, once per node).
- Streams: `ShardedIterable` and `stream_share` (an IterableDataset shared out across ranks and workers).
- k-fold cross-validation: `folds` (the training and validation indices of one fold, stratified by class)
  and `check_folds` (`data.num_folds` and `data.fold` checked, one sentence if wrong); numpy, no torch.
- Errors: `DataUnavailable` (missing data, said in one sentence with the fix).

The names are imported on first use: `import hpctrain.data` alone imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "ImageDataModule": "images",
    "Normalise": "images",
    "DataUnavailable": "images",
    "split": "images",
    "DownloadedImageDataModule": "downloads",
    "FileImageDataModule": "files",
    "ImageFolderDataModule": "files",
    "ShardsDataModule": "shards",
    "TokenizedDataModule": "tokens",
    "made_once": "tokens",
    "stage_folder": "staging",
    "TensorDataset": "loading",
    "ResumableDataLoader": "loading",
    "make_loader": "loading",
    "pin_memory_default": "loading",
    "tensors_to_device": "loading",
    "ShardedIterable": "iterable",
    "stream_share": "iterable",
    "folds": "kfold",
    "check_folds": "kfold",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
