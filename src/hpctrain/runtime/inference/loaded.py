"""A trained model ready to use, from one of this template's checkpoints, with no config to compose:

    import hpctrain
    model = hpctrain.load("logs/train/runs/<run>/checkpoints/last.ckpt")
    logits = model(images)            # uint8 images (B, C, H, W), as the datamodule's batches were

The checkpoint holds the resolved model and data config it was trained with (`reading.CONFIG_KEY`):
the LightningModule is rebuilt from it, as plain values whose every class is one this project's configs
name (`targets.check_stored`, `targets.build_stored`), and gets the weights (read with weights_only=True), and the
datamodule's `preprocessing()` (for the template's image datamodules: the normalisation) goes in front,
so the model is fed exactly what it was trained on. src/predict.py and src/export.py start from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run.build import built_from_file
from hpctrain.runtime.storage.checkpoints import reading, trainable_only

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule

# a sample larger than this (a 16k x 16k RGB image) is no image a file should claim
MAX_SAMPLE_ELEMENTS = 1 << 28


class Predictor(nn.Module):
    """`model(preprocess(images))`, in eval mode; `config` is the model and data config it was trained with."""

    def __init__(self, model: LightningModule, preprocess: nn.Module, config: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.preprocess = preprocess
        self.config = config
        self.eval()

    def forward(self, images: Tensor) -> Any:
        return self.model(self.preprocess(images))

    @property
    def image_shape(self) -> tuple[int, ...] | None:
        """The data's image shape as stored in the checkpoint's config (a file's value: checked)."""
        shape = (self.config.get("data") or {}).get("image_shape")
        if not shape:
            return None
        if not (
            isinstance(shape, list | tuple)
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
            and math.prod(shape) <= MAX_SAMPLE_ELEMENTS
        ):
            raise UserError(
                f"the checkpoint's config stores data.image_shape={str(shape)[:80]}, which is not the shape of an "
                f"image (positive whole numbers, at most {MAX_SAMPLE_ELEMENTS} values in all); pass a checkpoint "
                "written by src/train.py."
            )
        return tuple(shape)


def preprocessing_of(datamodule: Any) -> nn.Module:
    """The datamodule's `preprocessing()` (a module taking its raw batches' inputs), else nothing to do."""
    make = getattr(datamodule, "preprocessing", None)
    return make() if callable(make) else nn.Identity()


def load(
    ckpt_path: str | Path, trusted_targets: Iterable[str] | None = None, from_config: bool = False
) -> Predictor:
    """The model of a checkpoint of this template, with its preprocessing in front (see the module docstring).
    The classes built are those the project's configs name; `trusted_targets` adds others the user trusts
    (`from_config`: the entry points' `checkpoints.trusted_targets`, named so in the refusal)."""
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise UserError(
            f"{path} does not exist; pass a checkpoint file or folder (see <run dir>/checkpoints/)."
        )
    content = reading.read(path)
    how = "" if from_config else "hpctrain.load(path, trusted_targets=[<the target>])"
    stored = reading.stored_config(path, ("model", "data"), trusted_targets, how=how, content=content)
    if "model" not in stored:
        raise UserError(
            f"{path} holds no model config (it was not written by this template); build its LightningModule "
            "yourself and call load_state_dict(torch.load(path, weights_only=True)['state_dict'])."
        )
    module = built_from_file(stored["model"], "model")
    reading.check_matches_model(path, module, content=content)
    trainable_only.load_weights(module, content, str(path))
    preprocess = (
        preprocessing_of(built_from_file(stored["data"], "data")) if "data" in stored else nn.Identity()
    )
    return Predictor(module, preprocess, stored)
