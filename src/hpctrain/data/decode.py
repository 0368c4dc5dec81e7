"""Image files -> uint8 tensors (C, H, W) of a fixed shape: the one decoding path of the template.

Pillow decodes (JPEG and PNG; torchvision.io is deprecated in favour of TorchCodec, which needs a system
FFmpeg, and adds nothing for single still images). Each file is turned the way a camera meant it (EXIF
orientation), forced to the channels the model takes (1: grayscale, 3: RGB) and resized to its size,
deterministically (bilinear, Pillow's antialiasing), so the same file always gives the same tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from hpctrain.runtime.errors import UserError
from PIL import Image, ImageOps
from PIL import Image, UnidentifiedImageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_MODES = {1: "L", 3: "RGB"}


def image_files(folder: str | Path, what: str = "predict.input") -> list[Path]:
    """The PNG and JPEG files under `folder` (any depth), sorted by their path: one sentence if none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{what}={folder} is not a folder.")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise UserError(f"{what}={folder} holds no image files (.png, .jpg, .jpeg).")
    return files


def decode_image(path: str | Path, image_shape: Sequence[int]) -> Tensor:
    """The image in `path` as uint8 (C, H, W) with `image_shape`; one sentence naming the file if it cannot be read."""
    try:
        return decode(path, image_shape)
    except UnreadableImage as err:
        raise UserError(f"{path} cannot be read as an image ({err}); remove or replace the file.") from err


class UnreadableImage(Exception):
    """A file that is not an image, or a truncated or corrupt one; the message is the reason."""


def decode(source: str | Path | BinaryIO, image_shape: Sequence[int]) -> Tensor:
    """A file (path or open binary file, e.g. the bytes of a shard) as uint8 (C, H, W) with `image_shape`."""
    out = torch.empty(tuple(int(d) for d in image_shape), dtype=torch.uint8)
    decode_into(source, out.numpy())
    return out


def decode_into(source: str | Path | BinaryIO, out: np.ndarray) -> None:
    """Decode a file into `out`, a uint8 (C, H, W) array (a batch's slot: one copy, no temporaries)."""
    channels, height, width = out.shape
    if channels not in _MODES:
        raise UserError(
            f"image files can be read as 1 (grayscale) or 3 (RGB) channels, not the {channels} of image shape "
            f"{list(out.shape)}."
        )
    try:
        with Image.open(source) as image:
            # A JPEG's EXIF is in its header: without one there is no orientation to apply, and
            # exif_transpose's parse (a third of a small JPEG's decode time) can be skipped.
            if image.format != "JPEG" or "exif" in image.info:
                image = ImageOps.exif_transpose(image)
            image = image.convert(_MODES[channels])
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise UnreadableImage(" ".join(str(err).split())[:160] or type(err).__name__) from err
    np.copyto(out, pixels[None] if channels == 1 else pixels.transpose(2, 0, 1))


def check_headers(files: Sequence[Path]) -> None:
    """Open every file's header (cheap: no pixels are decoded), so a file that is not an image is one
    sentence before the run starts rather than an error in a loader worker halfway through."""
    for path in files:
        try:
            with Image.open(path):
                pass
        except (OSError, UnidentifiedImageError) as err:
            raise UserError(
                f"{path} is not a readable image ({type(err).__name__}); remove or replace the file."
            ) from err


class ImageFiles(Dataset):
    """The images of `files` as (uint8 image, -1): batches shaped like a labelled split's, so the
    datamodule's batch hooks (normalisation) treat them alike; `paths` are relative to `root`."""

    def __init__(self, files: Sequence[Path], image_shape: Sequence[int], root: str | Path) -> None:
        self.files = list(files)
        self.image_shape = tuple(int(d) for d in image_shape)
        self.paths = [str(Path(f).relative_to(root)) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return decode_image(self.files[index], self.image_shape), torch.tensor(-1)
