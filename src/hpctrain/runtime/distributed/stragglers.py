"""Stragglers named: a rank markedly slower than the others, found without a collective or a host sync.

Under DDP every rank waits for the slowest in the gradient all-reduce, so the wall time per step is the
same everywhere; what differs is each rank's own work before it arrives there. Per rank, two host
clocks per step (plain float arithmetic, no device sync) split it in two:

- between steps: from the end of one training step to the start of the next: fetching the next batch
  (waiting for data) and the batch-start hooks;
- forward: from the start of the step to its backward pass (the module's training_step).

Each rank's watchdog thread writes its running sums to the job's store about once a second (off the
training thread), and rank 0's reads them every `diagnostics.straggler_every_s` seconds: a rank whose
own time per step is `diagnostics.straggler_factor` times the median of the others' or more gets one
line, e.g. `straggler: rank 3 (node2) 1.8x the others' median step (12.0 ms vs 6.6 ms), 70% of it
between steps (loading data, batch-start hooks)`. The same figures go to metrics.csv at that rate
(`ranks/own_ms/<rank>`) and, for the whole run, to outcome.yaml (`ranks:`).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any

log = logging.getLogger("hpctrain")

TIMING_KEY = "hpctrain/timing"  # + /<rank>: "<steps> <between steps s> <forward s> <host>"


class StepClock:
    """This rank's running sums, updated by the training thread (see the module docstring)."""

    def __init__(self) -> None:
        self.steps = 0
        self.between_s = 0.0
        self.forward_s = 0.0
        self._ended: float | None = None
        self._started = 0.0

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._ended is not None:
            self.between_s += now - self._ended
        self._started = now

    def backward_started(self) -> None:
        self.forward_s += time.perf_counter() - self._started
        self.steps += 1

    def step_ended(self) -> None:
        self._ended = time.perf_counter()

    def epoch_ended(self) -> None:
        self._ended = None  # validation between epochs is not a wait for data

    def record(self) -> str:
        return f"{self.steps} {self.between_s} {self.forward_s} {socket.gethostname()}"


class StragglerReport:
    """Rank 0's view: reads every rank's sums from the store and compares the last window's per-step times."""

    def __init__(self, world_size: int, every_s: float, factor: float) -> None:
        self.world_size = world_size
        self.every_s = every_s
        self.factor = factor
        self._last_report = time.monotonic()
        self._previous: dict[int, tuple[int, float, float]] = {}
        self.latest: dict[int, float] = {}  # rank -> own ms per step in the last window (for metrics.csv)
        self.totals: dict[int, tuple[int, float, float, str]] = {}

    def read(self, store: Any) -> dict[int, tuple[int, float, float, str]]:
        """Each rank's published sums. A rank that trained no step in this attempt (one resumed at the end
        of training) published none: `store.get` would wait for its key until the store's timeout."""
        found = {}
        for rank in range(self.world_size):
            key = f"{TIMING_KEY}/{rank}"
            try:
                if not store.check([key]):
                    continue
                steps, between, forward, host = store.get(key).decode().split(" ", 3)
                found[rank] = (int(steps), float(between), float(forward), host)
            except Exception:
                continue
        return found

    def due(self) -> bool:
        return self.every_s > 0 and time.monotonic() - self._last_report >= self.every_s

    def report(self, store: Any) -> list[str]:
        """The straggler lines for the window since the last report (none when no rank stands out)."""
        self._last_report = time.monotonic()
        sums = self.read(store)
        self.totals = sums
        window: dict[int, tuple[float, float, str]] = {}
        for rank, (steps, between, forward, host) in sums.items():
            before = self._previous.get(rank, (0, 0.0, 0.0))
            n = steps - before[0]
            if n > 0:
                window[rank] = ((between - before[1]) / n, (forward - before[2]) / n, host)
            self._previous[rank] = (steps, between, forward)
        self.latest = {rank: 1000 * (b + f) for rank, (b, f, _) in window.items()}
        return lines(window, self.factor)

    def summary(self) -> dict[int, dict[str, Any]]:
        """For outcome.yaml: each rank's mean times per step over the whole run."""
        result = {}
        for rank, (steps, between, forward, host) in sorted(self.totals.items()):
            if steps:
                result[rank] = {
                    "host": host,
                    "steps": steps,
                    "own_ms_per_step": round(1000 * (between + forward) / steps, 3),
                    "between_steps_ms": round(1000 * between / steps, 3),
                    "forward_ms": round(1000 * forward / steps, 3),
                }
        return result


def lines(window: dict[int, tuple[float, float, str]], factor: float) -> list[str]:
    """One line per rank whose own time per step is `factor` times the median of the others' or more."""
    found = []
    own = {rank: between + forward for rank, (between, forward, _) in window.items()}
    for rank, mine in sorted(own.items()):
        others = [t for r, t in own.items() if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and mine >= factor * median:
            between, _, host = window[rank]
            found.append(
                f"straggler: rank {rank} ({host}) {mine / median:.1f}x the others' median step "
                f"({1000 * mine:.1f} ms vs {1000 * median:.1f} ms), {100 * between / mine:.0f}% of it between steps "
                "(loading data, batch-start hooks)"
            )
    return found
