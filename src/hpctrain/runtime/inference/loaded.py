"""A trained model ready to use, from one of this template's checkpoints, with no config to compose:

    import hpctrain
    model = hpctrain.load("logs/train/runs/<run>/checkpoints/last.ckpt")
    logits = model(images)            # uint8 images (B, C, H, W), as the datamodule's batches were

The checkpoint proposes the options and values it was trained with; this project's own configs build the
model and the data from them (`hpctrain.runtime.config.proposals`: a file never names code or a place),
the model without memory until it is compared with the file's tensors, then with the weights (read with
weights_only=True), and the datamodule's `preprocessing()` (for the template's image datamodules: the
normalisation) goes in front, so the model is fed exactly what it was trained on. A `.safetensors` export
of this project loads the same way. src/predict.py and src/export.py start from here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from hpctrain.runtime.config import proposals, redact
from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run import build
from hpctrain.runtime.storage.checkpoints import reading, trainable_only

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule

# a sample larger than this (a 16k x 16k RGB image) is no image a file should claim
MAX_SAMPLE_ELEMENTS = 1 << 28


class Predictor(nn.Module):
    """`model(preprocess(images))`, in eval mode; `config` is the model and data config it was trained with."""

    def __init__(
        self, model: LightningModule, preprocess: nn.Module, config: dict[str, Any], overrides: list[str]
    ) -> None:
        super().__init__()
        self.model = model
        self.preprocess = preprocess
        self.config = config  # what a checkpoint of it proposes: its options and values
        self.overrides = overrides  # what the command line gave to compose it
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


def load(path: str | Path, overrides: Iterable[str] = ()) -> Predictor:
    """The model of a checkpoint (or a `.safetensors` export) of this project, with its preprocessing in
    front (see the module docstring); `overrides`: what the command line would add (`hydra.searchpath=...`,
    `model._target_=...` for a class the project's configs do not give)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(
            f"{path} does not exist; pass a checkpoint file or folder (see <run dir>/checkpoints/)."
        )
    content = _exported(path) if path.suffix == ".safetensors" else reading.read(path)
    found = reading.proposal(path, content, what="")
    if found is None:
        raise UserError(
            f"{path} holds no model config (it was not written by this template); build its LightningModule "
            "yourself and call load_state_dict(torch.load(path, weights_only=True)['state_dict'])."
        )
    given = proposals.relevant(list(overrides))
    cfg = proposals.composed(found, given, lambda chosen: compose("train", chosen))
    module = build.model(cfg.model, checkpoint=build.Checkpoint(path, content))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_model

        load_model(module, str(path))  # an export: tensors shared by two names are stored once
    else:
        trainable_only.load_weights(module, content, str(path))
    with build.namespace_of_run(cfg):
        data = build.instantiated(cfg.data, "data", num_workers=0)
    stored = redact.recorded(cfg, proposals.GROUPS)  # as a checkpoint stores them
    choices = proposals.chosen(found, given)  # an export records them again
    return Predictor(module, preprocessing_of(data), {"choices": choices, **stored}, given)


def _exported(path: Path) -> dict[str, Any]:
    """A `.safetensors` export's weights and the config its metadata proposes (src/export.py writes it)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        config = (file.metadata() or {}).get("config")
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (a safetensors handle)
    try:
        stored = json.loads(config[: proposals.MAX_TEXT * 64]) if config else None
    except ValueError as err:
        raise UserError(
            f"{path} holds a config that is not JSON in its metadata; export it again with src/export.py."
        ) from err
    return (
        {"state_dict": tensors, reading.CONFIG_KEY: stored} if stored is not None else {"state_dict": tensors}
    )
