"""summary.csv and summary.png of a sweep: one row per job, from what each job left in its run dir."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

from hpctrain.runtime.report import plots
from hpctrain.runtime.run import records

log = logging.getLogger(__package__.split(".")[0])

COLUMNS = ("job", "status", "overrides", "metric", "value", "run_dir", "slurm_log", "error")


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
        return [str(o) for o in yaml.safe_load(hydra_record.read_text()) or []]
    return []


def rows(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per job, and the keys whose values differ between jobs (what was swept)."""
    found = []
    for run_dir in job_dirs(sweep_dir):
        outcome, record = records.read_outcome(run_dir), records.read_run_record(run_dir)
        attempts = record.get("attempts") or [{}]
        found.append(
            {
                "job": int(run_dir.name),
                "status": outcome.get("status") or ("running" if attempts != [{}] else "not started"),
                "overrides": _overrides(run_dir, record, outcome),
                "metric": outcome.get("metric") or "",
                "value": outcome.get("value") if outcome.get("value") is not None else "",
                "run_dir": str(run_dir),
                "slurm_log": attempts[-1].get("slurm_log") or "",
                "error": outcome.get("error") or "",
            }
        )
    values: dict[str, set[str]] = {}
    for row in found:
        for override in row["overrides"]:
            key, _, value = override.lstrip("+~").partition("=")
            values.setdefault(key, set()).add(value)
    varying = sorted(key for key, seen in values.items() if len(seen) > 1 or len(found) == 1)
    for row in found:
        row["overrides"] = " ".join(
            o for o in row["overrides"] if o.lstrip("+~").partition("=")[0] in varying
        )
    return found, varying


def write_summary(
    sweep_dir: Path, table: list[dict[str, Any]], varying: list[str]
) -> tuple[Path, Path | None]:
    """Write <sweep dir>/summary.csv (and summary.png when some job has a value); return their paths."""
    csv_path = sweep_dir / "summary.csv"
    with open(csv_path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    png = None
    if any(row["value"] != "" for row in table):
        png = plots.plot_sweep(table, varying, sweep_dir / "summary.png")
    return csv_path, png


def report(sweep_dir: str | Path) -> None:
    """Write the summary and log one line per job: status, value, where its run dir and log are."""
    table, varying = rows(Path(sweep_dir))
    csv_path, png = write_summary(Path(sweep_dir), table, varying)
    for row in table:
        value = f"{row['metric']}={row['value']:.4g}" if isinstance(row["value"], float) else "no value"
        where = row["run_dir"] + (f", log {row['slurm_log']}" if row["slurm_log"] else "")
        why = f": {row['error']}" if row["error"] else ""
        log.info("job %d %s (%s) %s  %s%s", row["job"], row["status"], row["overrides"], value, where, why)
    log.info("sweep summary: %s%s", csv_path, f" and {png}" if png else "")


class SweepSummary(HydraCallback):
    """Hydra callback: when a sweep (-m) ends, write its summary.csv and summary.png."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from hpctrain.runtime.run.job import SKIPPED

        sweep_dir = Path(str(config.hydra.sweep.dir))
        if SKIPPED:
            log.info(
                "skip_completed: %d point(s) had completed in %s with the same config and were skipped (jobs %s)",
                len(SKIPPED),
                sweep_dir,
                ", ".join(map(str, SKIPPED)),
            )
        if sweep_dir.is_dir():
            report(sweep_dir)
