"""hpctrain: a PyTorch Lightning + Hydra template that trains the same code on a laptop and on SLURM.

Importing the package is cheap (no torch); the heavy modules are imported where they are used.
Importing it registers the config resolvers (`hpctrain.resolvers`), so any process that rebuilds a
config, however it was started, can resolve it.
"""

from hpctrain.config import PROJECT_ROOT
from hpctrain.resolvers import register_resolvers

__version__ = "0.1.0"

register_resolvers(PROJECT_ROOT)
