"""Print the overrides of one job of a Hydra sweep grid, one per line: the job of this SLURM array task.

    python scripts/sweep_point.py model.optimizer.lr=0.1,0.01 data.batch_size=64,128   # in slurm/sweep.sbatch

The job is the array task's index in Hydra's own job order (hydra.job.num); a job array whose number of
tasks is not the grid's size is refused with one sentence (it would skip points or run one twice),
unless it re-runs the missing points of an earlier sweep (HPCTRAIN_SWEEP_DIR, set by scripts/submit.py
--sweep with skip_completed=true): then its task ids are the job numbers of those points.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.environment.launched import array_task, resumed_sweep_dir
from hpctrain.runtime.errors import UserError, reported_as_one_sentence
from hpctrain.runtime.sweeps.grid import expand


def main(argv: list[str]) -> None:
    with reported_as_one_sentence():
        jobs = expand(argv)
        task, tasks, first, last = array_task()
        if resumed_sweep_dir() is not None:  # the missing points of an earlier sweep: ids are job numbers
            if not 0 <= task < len(jobs):
                raise UserError(
                    f"array task {task} is not a job of the sweep grid, which has {len(jobs)} point(s)."
                )
        elif tasks not in (None, len(jobs)) or first != "0":
            raise UserError(
                f"the sweep grid has {len(jobs)} point(s) but the job array has {tasks} task(s) "
                f"(--array={first}-{last}); submit with --array=0-{len(jobs) - 1} "
                "(python scripts/submit.py --sweep ... computes it)."
            )
        print("\n".join(jobs[task]))


if __name__ == "__main__":
    main(sys.argv[1:])
