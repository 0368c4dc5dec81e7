"""A Hydra sweep grid (`lr=0.1,0.01 batch_size=64,128`), expanded into its jobs in Hydra's own order:
job k here is the job Hydra's basic sweeper numbers `hydra.job.num=k` for the same overrides."""

from __future__ import annotations

from collections.abc import Sequence


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of every job of the grid, in order (one job, the overrides, when nothing is swept)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]
