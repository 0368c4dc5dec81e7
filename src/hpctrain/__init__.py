"""hpctrain: a PyTorch Lightning + Hydra template that trains the same code on a laptop and on SLURM.

Importing the package is cheap (no torch); the heavy modules are imported where they are used.
Importing it registers the config resolvers (`hpctrain.runtime.config.resolvers`), so any process that rebuilds a
config, however it was started, can resolve it.
"""

from hpctrain.runtime import moved
from hpctrain.runtime.config.compose import PROJECT_ROOT
from hpctrain.runtime.config.resolvers import register_resolvers

__version__ = "0.1.0"

register_resolvers(PROJECT_ROOT)
moved.install()  # the import paths machinery modules had before hpctrain.runtime keep working
