"""What the template's subclasses of Lightning callbacks share."""

from __future__ import annotations


class CachedStateKey:
    """Lightning formats a callback's state key on every hook call (it names the profiler region);
    these callbacks' keys never change after construction, so compute them once."""

    _cached_state_key: str | None = None

    @property
    def state_key(self) -> str:
        if self._cached_state_key is None:
            self._cached_state_key = super().state_key  # type: ignore[misc]
        return self._cached_state_key
