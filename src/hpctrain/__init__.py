"""hpctrain: a PyTorch Lightning + Hydra template that trains the same code on a laptop and on SLURM.

Importing the package is cheap (no torch); the heavy modules are imported where they are used.
"""

__version__ = "0.1.0"
