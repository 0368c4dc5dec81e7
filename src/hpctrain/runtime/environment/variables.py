"""The variables the modules of this package read: the process's environment, or the mapping a caller
gives instead (a test's, or another process's)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def variables(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """`env`, or this process's environment when it is None."""
    return os.environ if env is None else env


def int_or_none(value: object) -> int | None:
    """`value` as an int, or None when it is not one (unset, empty, `2(x3)`)."""
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
