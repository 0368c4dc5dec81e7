"""Random images and labels, for smoke tests and benchmarks: any size, no files, nothing to learn."""

from __future__ import annotations

import torch

from hpctrain.data import ImageDataModule
from hpctrain.data import TensorDataset


class RandomDataModule(ImageDataModule):
    def __init__(
        self,
        num_samples: int = 10_000,
        val_samples: int = 1_000,
        test_samples: int = 1_000,
        num_classes: int = 10,
        image_shape: tuple[int, ...] = (1, 28, 28),
        **image_args,
    ) -> None:
        super().__init__(num_classes=num_classes, image_shape=image_shape, **image_args)
        self.sizes = (num_samples, val_samples, test_samples)

    def load(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        generator = torch.Generator().manual_seed(self.seed)
        return tuple(  # type: ignore[return-value]
            TensorDataset(
                torch.randint(0, 256, (size, *self.image_shape), dtype=torch.uint8, generator=generator),
                torch.randint(0, self.num_classes, (size,), generator=generator),
            )
            for size in self.sizes
        )
