"""Pictures of what a run or a sweep logged, as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

import csv
import io
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from hpctrain.runtime import confined

CURVES_FILE = "curves.png"
RANKS_FILE = "ranks.png"
# per-rank figures that curves.png shows (one line per rank); the rest are in ranks.png (scripts/plot.py)
CURVES_PER_RANK = ("samples_per_s", "data_wait")


def _pyplot() -> Any:
    import matplotlib  # imported on a torch-free path (the run's report): only when a figure is drawn

    matplotlib.use("Agg")  # no display on a cluster node; set before pyplot is imported
    import matplotlib.pyplot as plt

    return plt


def _saved(plt: Any, figure: Any, path: Path) -> Path:
    """`figure` laid out and written to `path` as a PNG, then closed; the path."""
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)  # pyplot holds every figure until it is closed
    return path


def read_series(metrics_csv: Path) -> dict[str, list[tuple[float, float]]]:
    """metric -> [(step, value)] from a csv logger's metrics.csv (empty cells skipped)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    text = confined.read_text(metrics_csv, "table", folder=metrics_csv.parent)
    for row in csv.DictReader(io.StringIO(text, newline="")):
        try:
            step = float(row.get("step") or 0)
        except (TypeError, ValueError):  # a row of another file's shape: not a point of any curve
            continue
        for key, value in row.items():
            if key in ("step", "epoch") or value in (None, ""):
                continue
            try:
                series[str(key)].append((step, float(value)))
            except (TypeError, ValueError):
                continue
    return dict(series)


def _panel(name: str) -> str | None:
    """The panel of curves.png a metric goes in; None for the per-rank and per-node detail."""
    if name.startswith(("ranks/", "perf/")):
        figure = name.split("/")[1]
        return figure if figure in CURVES_PER_RANK else None  # the job's and each rank's in one panel
    if name.startswith(("nodes/", "gpus/")):
        return None
    if name.endswith("samples_per_s"):
        return "samples_per_s"
    lowered = name.lower()
    for word in ("loss", "acc", "bpc", "lr"):
        if word in lowered:
            return word
    return name  # anything else gets a panel of its own


def plot_run(run_dir: str | Path) -> Path:
    """Plot every logged metric against the step, losses together, accuracies together; return the file."""
    run_dir = Path(run_dir)
    series = read_series(run_dir / "metrics.csv")
    panels: dict[str, list[str]] = defaultdict(list)
    for name in sorted(series, key=_natural):
        panel = _panel(name)
        if panel is not None:
            panels[panel].append(name)
    plt = _pyplot()
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * max(len(panels), 1)), squeeze=False)
    for axis, (panel, names) in zip(axes[:, 0], panels.items(), strict=True):
        for name in names:
            steps, values = zip(*series[name], strict=True)
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
        axis.set_ylabel(panel)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(run_dir.name, fontsize=9)
    return _saved(plt, figure, run_dir / CURVES_FILE)


def _natural(name: str) -> tuple[str, int]:
    """ranks/x/2 before ranks/x/10."""
    head, _, tail = name.rpartition("/")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


def plot_ranks(run_dir: str | Path) -> Path | None:
    """The per-rank view of a run: each figure the ranks logged (step time, data wait, samples/s, peak
    memory, the straggler report's own time), one line per rank against the step, and each GPU's
    utilisation and power; the title names the slowest rank. None when the run logged no per-rank figures."""
    run_dir = Path(run_dir)
    series = read_series(run_dir / "metrics.csv")
    panels: dict[str, list[str]] = defaultdict(list)
    for name in sorted(series, key=_natural):
        parts = name.split("/")
        if parts[0] == "ranks" and len(parts) == 3:
            panels[parts[1]].append(name)
        elif parts[0] == "gpus" and len(parts) == 4:
            panels[f"gpu {parts[3]}"].append(name)
    if not panels:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True, squeeze=False)
    for axis, (panel, names) in zip(axes[:, 0], panels.items(), strict=True):
        for name in names:
            steps, values = zip(*series[name], strict=True)
            label = name.split("/", 2)[2] if panel.startswith("gpu") else f"rank {name.rsplit('/', 1)[1]}"
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        axis.set_ylabel(panel, fontsize=8)
        axis.grid(alpha=0.3)
        if len(names) <= 16:
            axis.legend(fontsize=7, ncol=min(len(names), 8))
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(f"{run_dir.name}: {slowest_rank(series)}", fontsize=9)
    return _saved(plt, figure, run_dir / RANKS_FILE)


def slowest_rank(series: dict[str, list[tuple[float, float]]]) -> str:
    """Which rank was slowest over the run, by its median step time."""
    steps = {
        name.rsplit("/", 1)[1]: statistics.median(v for _, v in points)
        for name, points in series.items()
        if name.startswith("ranks/step_ms/") and points
    }
    if len(steps) < 2:
        return "one rank"
    rank = max(steps, key=lambda r: steps[r])
    others = statistics.median(v for r, v in steps.items() if r != rank)
    return f"rank {rank} slowest, median step {steps[rank]:.1f} ms vs the others' {others:.1f} ms"


def plot_sweep(
    rows: list[dict[str, Any]], varying: list[str], path: Path, groups: list[dict[str, Any]] | None = None
) -> Path:
    """The monitored metric per job (bars), or against the one swept number when only one was swept.

    With `groups` (summary_groups.csv's rows) of which one has more than one value: each group's mean
    with its 95 % confidence interval as the error bar, and its points' values beside it."""
    metric = next((r["metric"] for r in rows if r["metric"]), "value")
    if groups and any(int(g.get(f"{metric}_n") or 0) > 1 for g in groups):
        return _plot_groups(rows, groups, metric, path)
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    done = [r for r in rows if r["value"] not in (None, "")]
    numbers = _numbers([r["overrides"] for r in done], varying)
    if numbers is not None and len(done) > 1:
        pairs = sorted(zip(numbers, (float(r["value"]) for r in done), strict=True))
        axis.plot(*zip(*pairs, strict=True), marker="o")
        axis.set_xlabel(varying[0])
        if min(numbers) > 0 and max(numbers) / min(numbers) >= 100:
            axis.set_xscale("log")
    else:
        labels = [f"{r['job']}: {r['overrides']}" for r in rows]
        values = [float(r["value"]) if r["value"] not in (None, "") else 0.0 for r in rows]
        colours = ["tab:blue" if r["status"] == "completed" else "tab:red" for r in rows]
        axis.bar(range(len(rows)), values, color=colours)
        axis.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=7)
    axis.set_ylabel(metric)
    axis.grid(alpha=0.3)
    return _saved(plt, figure, path)


def _plot_groups(rows: list[dict[str, Any]], groups: list[dict[str, Any]], metric: str, path: Path) -> Path:
    """Group means with 95 % intervals, against the one number that names the groups, else as bars."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(groups)), 4))
    names = [g["group"] for g in groups]
    keys = {name.split("=", 1)[0] for name in names}
    numbers = _numbers(names, list(keys)) if len(keys) == 1 and all(" " not in n for n in names) else None
    if numbers is not None and len(groups) > 1:
        where = dict(zip(names, numbers, strict=True))
        axis.set_xlabel(keys.pop())
        if min(numbers) > 0 and max(numbers) / min(numbers) >= 100:
            axis.set_xscale("log")
    else:
        where = {name: float(i) for i, name in enumerate(names)}
        axis.set_xticks(
            range(len(names)),
            [f"{n} (n={g[f'{metric}_n']})" for n, g in zip(names, groups, strict=True)],
            rotation=30,
            ha="right",
            fontsize=7,
        )
    done = [g for g in groups if g.get(f"{metric}_mean") not in (None, "")]
    done.sort(key=lambda g: where[g["group"]])
    x = [where[g["group"]] for g in done]
    means = [float(g[f"{metric}_mean"]) for g in done]
    low = [
        m - float(g[f"{metric}_ci95_low"]) if g[f"{metric}_ci95_low"] != "" else 0.0
        for m, g in zip(means, done, strict=True)
    ]
    high = [
        float(g[f"{metric}_ci95_high"]) - m if g[f"{metric}_ci95_high"] != "" else 0.0
        for m, g in zip(means, done, strict=True)
    ]
    axis.errorbar(
        x, means, yerr=[low, high], fmt="o-" if numbers is not None else "o", capsize=4, label="mean, 95 % CI"
    )
    points = [
        (where[r["group"]], float(r["value"]))
        for r in rows
        if r["value"] not in (None, "") and r.get("group") in where
    ]
    if points:
        axis.scatter(*zip(*points, strict=True), s=12, color="grey", alpha=0.6, zorder=3, label="points")
    axis.set_ylabel(metric)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return _saved(plt, figure, path)


def _numbers(overrides: list[str], varying: list[str]) -> list[float] | None:
    if len(varying) != 1:
        return None
    found = []
    for text in overrides:
        value = next(
            (part.split("=", 1)[1] for part in text.split() if part.startswith(f"{varying[0]}=")), None
        )
        try:
            found.append(float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    return found
