"""Tests of this project's code. hpctrain's plugin gives the contract tests (tests/contract) their options
and fixtures, and the `slurm_cluster` fixture: a real two-node Slurm cluster on this machine."""

pytest_plugins = ["hpctrain.testing.plugin"]
