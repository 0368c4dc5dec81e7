"""Bad input is reported as one sentence and a non-zero exit, never as a stack trace."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the command, the config or the environment that the user can fix.

    The message is one sentence that names the bad value, what was expected, and the fix.
    """


@contextmanager
def reported_as_one_sentence() -> Iterator[None]:
    """Turn a `UserError` raised inside the block into `error: <sentence>` on stderr and exit 2."""
    try:
        yield
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
