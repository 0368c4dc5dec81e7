import torch
from sklearn.datasets import load_digits

from hpctrain.data import ImageDataModule, TensorDataset, split


class MyData(ImageDataModule):
    """scikit-learn's 1,797 handwritten digits, 8x8 grey images, held in memory as uint8."""

    # the pixels' mean and std (in [0, 1], per channel): hpctrain normalises with them on the device
    default_mean = (0.305,)
    default_std = (0.376,)

    def load(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        digits = load_digits()  # bundled with scikit-learn: no download
        images = torch.as_tensor(digits.images * 255 / 16).round().to(torch.uint8).unsqueeze(1)
        labels = torch.as_tensor(digits.target, dtype=torch.int64)
        rest, test = split(TensorDataset(images, labels), holdout=360)
        train, val = split(rest, holdout=144, seed=1)
        return train, val, test  # uint8 (N, 1, 8, 8) and int64 labels
