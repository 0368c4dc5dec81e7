"""A sweep's summary, from what each job left in its run dir (`run.yaml`, `outcome.yaml`):

- summary.csv: one row per job (status, overrides, the monitored metric's best value, run dir, SLURM
  log, error), the statistics of its group (`group`, `group_n`, `group_mean`, ... of that metric) and
  its cost (`attempts`, `wall_hours`, `device_hours`, `redone_device_hours`, `cost_unit`);
- summary_groups.csv: one row per group of points that differ only in the keys averaged over (`seed`
  and `data.fold` by default; `hpctrain.runtime.sweeps.groups`): its failed and missing points, named,
  per metric (the monitored one, each test metric) n, mean, std, sem and the 95 % interval, and the
  sum of its points' cost;
- summary.png: the metric per job, or each group's mean with its 95 % interval when a group has more
  than one value.
At a sweep's end its one-line headline is also posted as a notification (`notify`: sweep).
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.runtime import confined
from hpctrain.runtime.confined import check_no_links_out
from hpctrain.runtime.report import plots
from hpctrain.runtime.storage import records
from hpctrain.runtime.storage.attempts import COST_COLUMNS, cost_cells, summed_cost
from hpctrain.runtime.sweeps.groups import OVER, Group, group_points, point_of

log = logging.getLogger(__package__.split(".")[0])


GROUP_COLUMNS = (
    "group",
    "group_n",
    "group_mean",
    "group_std",
    "group_sem",
    "group_ci95_low",
    "group_ci95_high",
)
COLUMNS = (
    *("job", "status", "overrides", "metric", "value", "run_dir", "slurm_log", "error"),
    *GROUP_COLUMNS,
    *COST_COLUMNS,  # the run's cost in total (outcome.yaml `cost`); per group: their sums
)
GROUPS_FILE = "summary_groups.csv"


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job run dirs (named by job number), in job order."""
    found = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(found, key=lambda p: int(p.name))


def _overrides(run_dir: Path, *records: dict[str, Any]) -> list[str]:
    """The job's overrides: from its run.yaml or outcome.yaml, else from Hydra's own record."""
    for record in records:
        if record.get("overrides") is not None:
            return [str(o) for o in record["overrides"]]
    hydra_record = run_dir / ".hydra" / "overrides.yaml"
    if hydra_record.is_file():
        return [str(o) for o in confined.read_yaml(hydra_record, folder=run_dir) or []]
    return []


def _number(value: Any) -> float | str:
    """A recorded number as a float, else "" (no value)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return ""


def rows(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per job, and the keys whose values differ between jobs (what was swept). Besides its
    csv cells a row holds its `point` (key -> value of all its overrides) and its `test` metrics."""
    found = []
    for run_dir in job_dirs(sweep_dir):
        outcome, record = records.read_outcome(run_dir), records.read_run_record(run_dir)
        attempts = record.get("attempts") or [{}]
        overrides = _overrides(run_dir, record, outcome)
        test = outcome.get("test") if isinstance(outcome.get("test"), dict) else {}
        found.append(  # values only, numbers where numbers go: a sweep dir may be someone else's
            {
                "job": int(run_dir.name),
                "status": str(outcome.get("status") or ("running" if attempts != [{}] else "not started")),
                "overrides": overrides,
                "metric": str(outcome.get("metric") or ""),
                "value": _number(outcome.get("value")),
                "run_dir": str(run_dir),
                "slurm_log": str(attempts[-1].get("slurm_log") or ""),
                "error": str(outcome.get("error") or ""),
                "point": point_of(overrides),
                "test": {str(k): v for k, v in test.items() if _number(v) != ""},
                **cost_cells(outcome.get("cost")),
            }
        )
    values: dict[str, set[str]] = {}
    for row in found:
        for key, value in row["point"].items():
            values.setdefault(key, set()).add(value)
    varying = sorted(key for key, seen in values.items() if len(seen) > 1 or len(found) == 1)
    for row in found:
        row["overrides"] = " ".join(
            o for o in row["overrides"] if o.lstrip("+~").partition("=")[0] in varying
        )
    return found, varying


def metrics(table: list[dict[str, Any]]) -> list[str]:
    """The metrics a sweep's groups summarise: the monitored one, then every test metric recorded."""
    monitored = next((row["metric"] for row in table if row["metric"]), None)
    tests = sorted({name for row in table for name in row["test"]} - {monitored})
    return ([monitored] if monitored else []) + tests


def group_rows(groups: list[Group], names: list[str]) -> list[dict[str, Any]]:
    """summary_groups.csv's rows: per group its points, failed and missing ones named, and per metric
    n, mean, std, sem and the 95 % interval."""
    found = []
    for group in groups:
        failed, missing = group.failed, group.missing
        row: dict[str, Any] = {
            "group": group.name,
            "points": len(group.points) + len(group.missing_points),
            "completed": sum(r["status"] == "completed" for r in group.points),
            "failed": len(failed),
            "missing": len(missing),
            "failed_points": "; ".join(failed),
            "missing_points": "; ".join(missing),
        }
        for name in names:
            row.update(group.stats(name).columns(f"{name}_"))
        row.update(summed_cost(group.points))
        found.append(row)
    return found


def _csv(path: Path, fieldnames: list[str] | tuple[str, ...], table: list[dict[str, Any]]) -> Path:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fieldnames, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    return path


@dataclass
class Summary:
    table: list[dict[str, Any]]  # summary.csv's rows, one per job
    groups: list[dict[str, Any]]  # summary_groups.csv's rows, one per group
    metric: str  # the monitored metric ("" when no job recorded one)
    files: list[Path]  # what was written: summary.csv, summary_groups.csv[, summary.png]

    def headline(self, mode: str | None = None) -> str:
        """One line for a notification: how the jobs ended, and the best value (`mode`: min or max)."""
        counts = Counter(str(row["status"]) for row in self.table)
        said = ", ".join(f"{n} {status}" for status, n in counts.most_common())
        line = f"{len(self.table)} jobs ({said})"
        valued = [row for row in self.table if isinstance(row["value"], (int, float))]
        if valued and mode in ("min", "max"):
            best = (min if mode == "min" else max)(valued, key=lambda row: row["value"])
            line += f"; best {self.metric}={best['value']:.4g} (job {best['job']}: {best['overrides']})"
        return f"{line}; summary: {self.files[0]}" if self.files else line


def summarise(
    sweep_dir: str | Path, over: Sequence[str] = OVER, group_by: Sequence[str] | None = None
) -> Summary:
    """Write <sweep dir>/summary.csv, summary_groups.csv and (when some job has a value) summary.png.
    Groups: the points that differ only in the keys of `over`; with `group_by`, the points that have the
    same values of those keys."""
    sweep_dir = Path(sweep_dir)
    table, varying = rows(sweep_dir)
    groups = group_points(table, varying, over, group_by)
    names = metrics(table)
    metric = next((row["metric"] for row in table if row["metric"]), "")
    for group in groups:
        stats = group.stats(metric).columns("group_")
        for row in group.points:
            row.update(stats, group=group.name)
    summary = group_rows(groups, names)
    fields = list(summary[0]) if summary else ["group", "points", "completed", "failed", "missing"]
    files = [_csv(sweep_dir / "summary.csv", COLUMNS, table), _csv(sweep_dir / GROUPS_FILE, fields, summary)]
    if any(row["value"] != "" for row in table):
        files.append(plots.plot_sweep(table, varying, sweep_dir / "summary.png", groups=summary))
    return Summary(table, summary, metric, files)


def report(
    sweep_dir: str | Path, over: Sequence[str] = OVER, group_by: Sequence[str] | None = None
) -> Summary:
    """Write the summary and log one line per job (status, value, where its run dir and log are) and one
    per group of more than one point (its mean and 95 % interval, what failed or is missing). A sweep dir
    holding a link out of it is refused before anything is written."""
    check_no_links_out(sweep_dir, "the sweep dir")
    summary = summarise(sweep_dir, over, group_by)
    for row in summary.table:
        value = f"{row['metric']}={row['value']:.4g}" if isinstance(row["value"], float) else "no value"
        where = row["run_dir"] + (f", log {row['slurm_log']}" if row["slurm_log"] else "")
        why = f": {row['error']}" if row["error"] else ""
        log.info("job %d %s (%s) %s  %s%s", row["job"], row["status"], row["overrides"], value, where, why)
    metric = summary.metric
    for group in summary.groups:
        if group["points"] < 2:
            continue
        mean = group.get(f"{metric}_mean", "")
        shown = f"{metric} {mean:.4g}" if mean != "" else "no value"
        low, high = group.get(f"{metric}_ci95_low", ""), group.get(f"{metric}_ci95_high", "")
        if low != "":
            shown += f" (95 % CI {low:.4g} to {high:.4g})"
        lost = "".join(
            f"; {kind}: {group[f'{kind}_points']}"
            for kind in ("failed", "missing")
            if group[f"{kind}_points"]
        )
        log.info("group %s: n=%s, %s%s", group["group"], group.get(f"{metric}_n", 0), shown, lost)
    spent = summed_cost(summary.table)
    if spent["cost_unit"]:
        log.info(
            "sweep cost: %.4g %s in %d attempt(s), %.4g of them redone",
            spent["device_hours"],
            spent["cost_unit"],
            spent["attempts"],
            spent["redone_device_hours"],
        )
    log.info("sweep summary: %s", ", ".join(map(str, summary.files)))
    return summary
