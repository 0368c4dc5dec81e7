"""Write summary.csv and summary.png for a sweep dir, e.g. after a SLURM job-array sweep.

python scripts/summarize.py logs/train/multiruns/slurm-1234
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.sweeps.summary import report


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: python scripts/summarize.py <sweep dir>  (a directory holding the jobs' run dirs 0, 1, ...)"
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
