"""Bad input is reported as one sentence and a non-zero exit, never as a stack trace.

Two sources of bad input, one form (`error: <sentence>` on stderr, exit status 2):
- mistakes the template recognises (`UserError`, raised anywhere; `reported_as_one_sentence`);
- mistakes Hydra finds while composing the config: an unknown key or group option, an override it
  cannot parse, a run dir it cannot create. Hydra prints those as several lines (a search-path dump
  for a missing option) and exits 1; `describe_hydra_error` makes them one line that keeps the list
  of valid options and suggests the closest one (`hpctrain.runtime.config.hydra_errors.describe_hydra_error`,
  which `hpctrain.runtime.config.command_line` hooks into Hydra).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hpctrain.runtime.secrets import hide

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
        print(f"error: {hide(str(err))}", file=sys.stderr, flush=True)  # a URL's secret parts hidden
        sys.exit(EXIT_USER_ERROR)
