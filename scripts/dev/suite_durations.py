"""Where the test suite spends its time: every test's wall time, per file and per tier.

    python scripts/dev/suite_durations.py --run                 # make durations: the whole suite, then the report
    python scripts/dev/suite_durations.py --junit results.xml   # a report of a run made already

`--run` runs the README's test command (`pytest -n 2 --dist worksteal`) with a JUnit XML file, then writes
`docs/benchmarks/<date>-suite.md` (the tables) and `docs/benchmarks/data/<date>-suite.json` (every test's
seconds), and `tests/durations.json`, the order the suite takes its tests in (longest first). A test's time is its setup, call and teardown together (a session fixture's cost lands on the
first test that asks for it). Each test's tier (quick, slow, slurm) and worker are recorded by
tests/conftest.py as JUnit properties; for an older file without them, a collection pass finds the tiers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIERS = ("slurm", "slow", "quick")
ORDER = ROOT / "tests" / "durations.json"


def _collected(marker: str) -> set[str]:
    printed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return {line.strip() for line in printed.stdout.splitlines() if "::" in line}


def read_junit(path: Path) -> list[dict]:
    """One row a test: id, file, seconds, tier, worker, outcome."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        file = "/".join(parts) + ".py"
        while parts and not (ROOT / ("/".join(parts) + ".py")).is_file():
            parts.pop()  # a class inside the module
        if parts:
            file = "/".join(parts) + ".py"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = kind
        rows.append(
            {
                "id": "::".join([file, *classname.split(".")[len(parts) :], name]),
                "file": file,
                "seconds": float(case.get("time", 0.0)),
                "tier": properties.get("tier"),
                "worker": properties.get("worker", "?"),
                "outcome": outcome,
            }
        )
    if any(row["tier"] is None for row in rows):
        slurm, quick = _collected("slurm"), _collected("not slow")
        for row in rows:
            if row["tier"] is None:
                row["tier"] = next(
                    (t for t, ids in (("slurm", slurm), ("quick", quick)) if _matches(row, ids)), "slow"
                )
    return rows


def _matches(row: dict, ids: set[str]) -> bool:
    name = row["id"].split("::")[-1]
    return any(i.startswith(row["file"]) and i.endswith("::" + name) for i in ids)


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def report(rows: list[dict], wall: float | None, top: int = 20) -> str:
    total = sum(r["seconds"] for r in rows)
    by_tier: dict[str, list[float]] = defaultdict(list)
    by_file: dict[str, list[float]] = defaultdict(list)
    by_worker: dict[str, float] = defaultdict(float)
    for r in rows:
        by_tier[r["tier"]].append(r["seconds"])
        by_file[r["file"]].append(r["seconds"])
        by_worker[r["worker"]] += r["seconds"]
    outcomes: dict[str, int] = defaultdict(int)
    for r in rows:
        outcomes[r["outcome"]] += 1
    lines = [
        f"- tests: {len(rows)} ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))})",
        f"- test time, all tests together: {total:,.0f} s",
    ]
    if wall is not None:
        lines.append(f"- wall time of the run: {wall:,.0f} s")
    if len(by_worker) > 1:
        lines.append("- per worker: " + ", ".join(f"{w} {s:,.0f} s" for w, s in sorted(by_worker.items())))
    lines += ["", "### Per tier", ""]
    lines += _table(
        ("tier", "tests", "seconds", "share"),
        [
            (t, len(by_tier[t]), f"{sum(by_tier[t]):,.0f}", f"{sum(by_tier[t]) / total:.0%}")
            for t in TIERS
            if t in by_tier
        ],
    )
    lines += ["", f"### The {top} longest tests", ""]
    longest = sorted(rows, key=lambda r: -r["seconds"])[:top]
    lines += _table(
        ("seconds", "tier", "test"), [(f"{r['seconds']:.1f}", r["tier"], f"`{r['id']}`") for r in longest]
    )
    lines += ["", "### Per file", ""]
    files = sorted(by_file.items(), key=lambda kv: -sum(kv[1]))
    lines += _table(("seconds", "tests", "file"), [(f"{sum(s):,.0f}", len(s), f"`{f}`") for f, s in files])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", action="store_true", help="run the whole suite (-n 2) first")
    source.add_argument("--junit", type=Path, help="the JUnit XML file of a run made already")
    parser.add_argument("--wall", type=float, help="the run's wall time in seconds, with --junit")
    parser.add_argument("--name", default=f"{datetime.date.today()}-suite", help="the report's file name")
    parser.add_argument(
        "--title", default="", help="a line under the report's heading (the machine, the commit)"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, with --run")
    args = parser.parse_args()
    wall = args.wall
    junit = args.junit
    if args.run:
        junit = ROOT / ".pytest_durations.xml"
        started = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-n",
                "2",
                "--dist",
                "worksteal",
                f"--junitxml={junit}",
                *args.pytest_args,
            ],
            cwd=ROOT,
        )
        wall = time.monotonic() - started
    rows = read_junit(junit)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    head = [
        f"# The test suite's durations ({args.name[:10]})",
        "",
        args.title
        or f"`make durations` at {commit.stdout.strip() or 'an unknown commit'}, {os.cpu_count()} cores, "
        f"{platform.machine()}, Python {platform.python_version()}.",
        "",
    ]
    out = ROOT / "docs" / "benchmarks" / f"{args.name}.md"
    out.write_text("\n".join(head) + "\n" + report(rows, wall))
    data = ROOT / "docs" / "benchmarks" / "data" / f"{args.name}.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps({"wall_s": wall, "tests": rows}, indent=1) + "\n")
    # the order the next runs take the tests in (tests/conftest.py): each test's seconds, rounded
    ORDER.write_text(
        json.dumps({r["id"]: round(r["seconds"], 1) for r in rows}, indent=0, sort_keys=True) + "\n"
    )
    print(f"wrote {out.relative_to(ROOT)}, {data.relative_to(ROOT)} and {ORDER.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
