"""A sweep's points in groups: the points that differ only in the keys averaged over (`seed` and
`data.fold` by default) are one group, and each group's metrics are summarised: n, mean, standard
deviation, standard error and the 95 % confidence interval of the mean (Student's t, n - 1 degrees of
freedom), of the monitored metric and of every test metric the points recorded.

A group also names its failed points, and its missing ones: points without a result that did not fail
(not started, still running, stopped), and, in a grid, the combinations of the averaged-over values that
other groups have and it has no run dir for (a job-array task that never ran). A sweep counts as a grid
over those keys when its points fill more than half of (groups x combinations); a random search does not.
No torch, numpy or scipy import: the statistics module and a table of t.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

OVER = ("seed", "data.fold")
ALL = "all"  # the name of the one group of a sweep whose points differ only in the averaged-over keys

# Student's t, 97.5 % quantile (two-sided 95 %), for 1 to 30 degrees of freedom
T_975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip


def t_975(df: int) -> float:
    """Student's t 97.5 % quantile with `df` degrees of freedom: the table, and above 30 the
    Cornish-Fisher expansion around the normal quantile (within 3e-8 of the exact value there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be 1 or more, not {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4)
    )


@dataclass(frozen=True)
class Stats:
    """n values summarised; with fewer than two, the spread is unknown (None)."""

    n: int
    mean: float | None = None
    std: float | None = None  # the sample standard deviation (n - 1)
    sem: float | None = None  # std / sqrt(n)
    ci95: tuple[float, float] | None = None  # mean -+ t(0.975, n - 1) * sem

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            return cls(0)
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(1, mean)
        std = statistics.stdev(values)
        sem = std / math.sqrt(len(values))
        half = t_975(len(values) - 1) * sem
        return cls(len(values), mean, std, sem, (mean - half, mean + half))

    def columns(self, prefix: str) -> dict[str, Any]:
        """As csv cells `<prefix>n`, `<prefix>mean`, ... (empty where unknown)."""
        low, high = self.ci95 if self.ci95 is not None else (None, None)
        cells = {
            "n": self.n,
            "mean": self.mean,
            "std": self.std,
            "sem": self.sem,
            "ci95_low": low,
            "ci95_high": high,
        }
        return {f"{prefix}{name}": "" if value is None else value for name, value in cells.items()}


@dataclass
class Group:
    name: str  # the overrides that define it, e.g. `model.optimizer.lr=0.01`; ALL when none do
    points: list[dict[str, Any]]  # its rows of summary.csv, in job order
    averaged: list[str]  # the keys averaged over
    missing_points: list[str] = field(default_factory=list)  # grid points with no run dir

    def values(self, metric: str) -> list[float]:
        """The metric's value at every completed point that recorded it (the monitored one or a test one)."""
        found = []
        for row in self.points:
            if row["status"] != "completed":
                continue
            value = row["value"] if metric == row["metric"] else (row.get("test") or {}).get(metric)
            if isinstance(value, (int, float)) and math.isfinite(value):
                found.append(float(value))
        return found

    def stats(self, metric: str) -> Stats:
        return Stats.of(self.values(metric))

    def _named(self, row: dict[str, Any]) -> str:
        where = " ".join(f"{k}={row['point'][k]}" for k in self.averaged if k in row["point"])
        return f"job {row['job']}" + (f" ({where})" if where else "")

    @property
    def failed(self) -> list[str]:
        return [self._named(row) for row in self.points if row["status"] == "failed"]

    @property
    def missing(self) -> list[str]:
        """Points without a result that did not fail, and the grid's points with no run dir."""
        unfinished = [
            f"{self._named(row)} {row['status']}"
            for row in self.points
            if row["status"] not in ("completed", "failed")
        ]
        return unfinished + [f"{point} (no run dir)" for point in self.missing_points]


def point_of(overrides: Iterable[str]) -> dict[str, str]:
    """key -> value of a job's overrides (`+key=value` and `~key` as key)."""
    point = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        point[key] = value
    return point


def group_points(
    table: list[dict[str, Any]],
    varying: Sequence[str],
    over: Sequence[str] = OVER,
    group_by: Sequence[str] | None = None,
) -> list[Group]:
    """The groups of `table` (summary.csv's rows, each with its `point`), in the order of their first job.

    The keys that define a group: `group_by`, else the swept keys that are not in `over`; every other
    swept key is averaged over."""
    order = [k for k in dict.fromkeys(k for row in table for k in row["point"]) if k in varying]  # as passed
    defining = list(group_by) if group_by is not None else [k for k in order if k not in over]
    averaged = [k for k in order if k not in defining]
    found: dict[str, Group] = {}
    for row in table:
        name = " ".join(f"{k}={row['point'][k]}" for k in defining if k in row["point"]) or ALL
        found.setdefault(name, Group(name, [], averaged)).points.append(row)
    groups = list(found.values())
    # the grid of averaged-over values: every value each key took somewhere in the sweep
    seen = [list(dict.fromkeys(row["point"].get(k) for row in table)) for k in averaged]
    combinations = list(itertools.product(*seen))
    if averaged and len(table) * 2 > len(groups) * len(combinations):
        for group in groups:
            present = {tuple(row["point"].get(k) for k in averaged) for row in group.points}
            group.missing_points = [
                " ".join(f"{k}={v}" for k, v in zip(averaged, combination, strict=True) if v is not None)
                for combination in combinations
                if combination not in present
            ]
    return groups
