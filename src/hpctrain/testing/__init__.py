"""What a project's tests use, carried with hpctrain: a pytest plugin (`plugin`: the contract tests'
options and fixtures, the local Slurm cluster as a fixture), the contract tests themselves (`contract`), and
a real two-node Slurm cluster on one machine (`local_slurm`). Only tests import this package."""
