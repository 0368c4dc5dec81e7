"""The driver of a packed job: slurm/pack.sbatch runs it as the job's one process. It runs several points
of a sweep grid side by side in the allocation, each its own srun step, and requeues the job once when
the time limit comes (hpctrain.runtime.sweeps.pack; submit with scripts/submit.py --sweep --pack N).

    python scripts/pack.py --pack=2 model.optimizer.lr=0.1,0.01 seed=1,2     # in slurm/pack.sbatch
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.sweeps.pack import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
