"""hpctrain: a PyTorch Lightning + Hydra template that trains the same code on a laptop and on SLURM.

Importing the package is cheap (no torch); the heavy modules are imported where they are used.
Importing it registers the config resolvers (`hpctrain.runtime.config.resolvers`), so any process that rebuilds a
config, however it was started, can resolve it.
"""

from hpctrain.runtime import moved
from hpctrain.runtime.config.compose import PROJECT_ROOT
from hpctrain.runtime.config.resolvers import register_resolvers

__version__ = "0.1.0"


def load(ckpt_path: str) -> "Predictor":  # noqa: F821
    """The model of one of this template's checkpoints, ready to call on the raw inputs its datamodule
    gave it (uint8 images: the normalisation is inside), in eval mode, on the CPU:

        model = hpctrain.load("logs/train/runs/<run>/checkpoints/last.ckpt")
        probabilities = model(images).softmax(dim=1)

    `model.model` is the LightningModule, `model.preprocess` what goes in front, `model.config` the model and
    data config it was trained with. torch is imported here, on the first call, not with the package."""
    from hpctrain.runtime.run.loaded import load as load_checkpoint

    return load_checkpoint(ckpt_path)


register_resolvers(PROJECT_ROOT)
moved.install()  # the import paths machinery modules had before hpctrain.runtime keep working
