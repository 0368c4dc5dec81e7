"""Plain words for what an export takes and gives: tensors' shapes and dtypes, the preprocessing in front
of the model, file sizes (the export's report and its model card)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn


def tensors(value: Any) -> list[Tensor]:
    """The tensors of a model's output (a tensor, or lists, tuples and dicts of them), in order."""
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return [value]


def describe_tensor(value: Tensor) -> str:
    """`uint8 (N, 1, 28, 28)`: the dtype, and the shape with any batch size N."""
    return f"{str(value.dtype).removeprefix('torch.')} ({', '.join(['N', *map(str, value.shape[1:])])})"


def input_name(inputs: Tensor) -> str:
    import torch

    return "images" if inputs.dtype == torch.uint8 and inputs.dim() == 4 else "inputs"


def describe(preprocess: nn.Module) -> str:
    """What goes in front of the model, in words."""
    from torch import nn

    from hpctrain.data.images import Normalise

    if isinstance(preprocess, nn.Identity):
        return "none (the model takes the data's batches as they are)"
    if isinstance(preprocess, Normalise):
        mean, std = list(preprocess.mean), list(preprocess.std)
        return f"x / 255, minus mean {mean}, divided by std {std}, per channel (float32)"
    return repr(preprocess)


def file_size(path: Path) -> str:
    """The size of a file, or of all the files of a folder (an export that is a folder)."""
    size = float(
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else path.stat().st_size
    )
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return ""
