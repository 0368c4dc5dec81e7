"""hpctrain: the machinery that trains a PyTorch Lightning + Hydra project the same way on a laptop CPU and
on a SLURM cluster (preflight, DDP and requeue, checkpoints and exact resume, sweeps, reports).

A project carries it untouched (src/hpctrain/, its configs in hpctrain/conf/); its own code uses only the
public API, versioned by `__version__` (semantic versioning, CHANGELOG.md beside this file):
- `hpctrain.data`: the datamodule base classes and loaders;
- `hpctrain.load`: a trained checkpoint's model, ready to call;
- `hpctrain.empty_weights`: build a large pretrained base without memory, read from its files later;
- `hpctrain.UserError`: a mistake said in one sentence with its fix (exit status 2).

Importing the package is cheap (no torch). It registers the config resolvers
(`hpctrain.runtime.config.resolvers`), so any process that rebuilds a config can resolve it.
"""

from hpctrain.runtime.config.compose import PROJECT_ROOT
from hpctrain.runtime.config.resolvers import register_resolvers
from hpctrain.runtime.errors import UserError

__version__ = "0.3.0"
__all__ = ["UserError", "__version__", "empty_weights", "load"]


def load(ckpt_path: str, overrides: "Iterable[str]" = ()) -> "Predictor":  # noqa: F821
    """The model of one of this project's checkpoints (or `.safetensors` exports), ready to call on the raw
    inputs its datamodule gave it (uint8 images: the normalisation is inside), in eval mode, on the CPU:

        model = hpctrain.load("logs/train/runs/<run>/checkpoints/last.ckpt")
        probabilities = model(images).softmax(dim=1)

    `model.model` is the LightningModule, `model.preprocess` what goes in front, `model.config` the model and
    data config it was built from. A checkpoint is data: it proposes the options and values it was trained
    with, and this project's own configs build the model from them (a class or a place the file names is
    never used; what they do not give is one sentence saying what to pass); `overrides` are what you would
    add on the command line (`hydra.searchpath=...`, `model._target_=...`). torch is imported here, on the
    first call, not with the package."""
    from hpctrain.runtime.inference.loaded import load as load_checkpoint

    return load_checkpoint(ckpt_path, overrides)


def empty_weights() -> "AbstractContextManager[None]":  # noqa: F821
    """A context in which the parameters a module creates take no memory (the meta device): build a large
    pretrained base inside it and name its files in the LightningModule's `pretrained_files()`
    ({parameter name: (safetensors file, tensor name)}); hpctrain reads them after the model is built,
    or under FSDP2 each rank its own shards after sharding (`hpctrain.runtime.distributed.materialize`)."""
    from hpctrain.runtime.distributed.materialize import empty_weights as context

    return context()


register_resolvers(PROJECT_ROOT)
