"""Plot a run's curves (everything its csv logger wrote) to <run dir>/curves.png, and, for a run of
several ranks, the per-rank view (which rank was slow, and when) to <run dir>/ranks.png.

python scripts/plot.py logs/train/runs/<run id>
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.confined import check_no_links_out
from hpctrain.runtime.errors import reported_as_one_sentence
from hpctrain.runtime.report.plots import plot_ranks, plot_run


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "metrics.csv").is_file():
        print("usage: python scripts/plot.py <run dir>  (a run dir holding metrics.csv)", file=sys.stderr)
        return 2
    with reported_as_one_sentence():
        check_no_links_out(argv[0])  # curves.png is written there: never through a link out of it
        print(plot_run(argv[0]))
        ranks = plot_ranks(argv[0])
    if ranks is not None:
        print(ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
