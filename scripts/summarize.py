"""Write summary.csv, summary_groups.csv and summary.png for a sweep dir, e.g. after a SLURM job-array sweep.

python scripts/summarize.py logs/train/multiruns/slurm-1234
python scripts/summarize.py DIR --over seed                       # average over the seeds only
python scripts/summarize.py DIR --group-by model.optimizer.lr     # one group per learning rate

Points that differ only in the keys averaged over (`--over`, by default seed and data.fold) form a
group: its mean, standard deviation, standard error and 95 % confidence interval, of the monitored
metric and of each test metric. `--group-by` names the keys that define the groups instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.errors import reported_as_one_sentence
from hpctrain.runtime.sweeps.groups import OVER
from hpctrain.runtime.sweeps.summary import report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/summarize.py",
        description="Summarise a sweep dir (a directory holding the jobs' run dirs 0, 1, ...).",
    )
    parser.add_argument("sweep_dir", type=Path, help="the sweep's multirun dir")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--over",
        nargs="+",
        default=list(OVER),
        metavar="KEY",
        help=f"the keys averaged over: points that differ only in them form a group (default: {' '.join(OVER)})",
    )
    keys.add_argument(
        "--group-by",
        nargs="+",
        metavar="KEY",
        help="the keys that define the groups; every other swept key is averaged over",
    )
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(
            f"{args.sweep_dir} is not a directory; pass a sweep's multirun dir (it holds 0/, 1/, ...)"
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with reported_as_one_sentence():  # a sweep dir holding a link out of it, say
        report(args.sweep_dir, over=args.over, group_by=args.group_by)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
