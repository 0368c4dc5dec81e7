"""Hydra finds launchers and sweepers only under the `hydra_plugins` package; the template's live in
its own package (`sweeps/`), and these names are how Hydra reaches them (see src/hpctrain/conf/hydra/launcher/slurm.yaml
and src/hpctrain/conf/hydra/sweeper/optuna.yaml)."""

from hpctrain.runtime.sweeps import optuna_sweeper, slurm


class SlurmLauncher(slurm.SlurmLauncher):
    """hpctrain.runtime.sweeps.slurm.SlurmLauncher, under the name Hydra accepts."""


class OptunaSweeper(optuna_sweeper.OptunaSweeper):
    """hpctrain.runtime.sweeps.optuna_sweeper.OptunaSweeper, under the name Hydra accepts."""
