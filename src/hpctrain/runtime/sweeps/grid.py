"""A Hydra sweep grid (`lr=0.1,0.01 batch_size=64,128`), expanded into its jobs in Hydra's own order:
job k here is the job Hydra's basic sweeper numbers `hydra.job.num=k` for the same overrides."""

from __future__ import annotations

from collections.abc import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from hpctrain.runtime.errors import UserError


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of every job of the grid, in order (one job, the overrides, when nothing is swept)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as err:
        bad = next((repr(o) for o in overrides if not _parses(OverridesParser, o)), "an override")
        detail = str(err).splitlines()[0]
        raise UserError(
            f"cannot parse {bad} ({detail}); quote values with special characters, e.g. 'key=\"a b\"', and close "
            "lists: key=[0.1,0.2]."
        ) from err
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def _parses(parser_class: type, override: str) -> bool:
    try:
        parser_class.create().parse_overrides([override])
    except Exception:
        return False
    return True
