"""The first two lines every entry point runs, before anything else is imported."""

from __future__ import annotations

from hpctrain.runtime.config import command_line
from hpctrain.runtime.distributed import signals


def start(task: str) -> None:
    """Record SLURM's signals from the first moment (by default they kill), and have Hydra report
    composition mistakes as one sentence and list `--help`'s groups once (`command_line`)."""
    signals.install_early()
    command_line.install(task)
