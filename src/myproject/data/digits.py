"""scikit-learn's bundled handwritten digits (1,797 8x8 images), laid out like MNIST: real data, offline."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.data import ImageDataModule, split
from hpctrain.data import TensorDataset


class DigitsDataModule(ImageDataModule):
    """Each 8x8 digit is resized to 20x20 and centred in 28x28, as MNIST digits are, so MNIST models take it."""

    default_mean = (0.1310,)
    default_std = (0.2920,)

    def __init__(
        self,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        num_classes: int = 10,
        image_shape: tuple[int, ...] = (1, 28, 28),
        **image_args,
    ) -> None:
        super().__init__(num_classes=num_classes, image_shape=image_shape, **image_args)
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction

    def load(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        pixels = F.interpolate(pixels, size=(20, 20), mode="bilinear", align_corners=False)
        images = (F.pad(pixels, (4, 4, 4, 4)).clamp(0, 1) * 255).round().to(torch.uint8)
        everything = TensorDataset(images, torch.as_tensor(digits.target, dtype=torch.int64))
        n = len(everything)
        rest, test = split(everything, round(n * self.test_fraction))
        train, val = split(rest, round(n * self.val_fraction), seed=1)
        return train, val, test


def write_image_folder(root: str | Path, per_split: int | None = None) -> Path:
    """The digits' train/val/test splits as an image folder, <root>/<split>/<class>/<n>.png (every third
    file a JPEG): real image files for data=image_folder, made offline. `per_split`: only the first so
    many of each split."""
    from PIL import Image

    root = Path(root)
    for split_name, part in zip(("train", "val", "test"), DigitsDataModule().load(), strict=True):
        count = len(part) if per_split is None else min(per_split, len(part))
        for i in range(count):
            folder = root / split_name / str(int(part.labels[i]))
            folder.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(part.images[i, 0].numpy())
            image.save(folder / (f"{i:05d}.jpg" if i % 3 == 2 else f"{i:05d}.png"))
    return root
