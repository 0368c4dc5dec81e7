"""Sweeps: many runs from one command, locally, as SLURM jobs or as a SLURM job array.

- one job of a sweep is `hpctrain.runtime.run.job.run_job`: its failure is recorded in its run dir, and
  the sweep goes on.
- `grid`: a Hydra sweep grid expanded in Hydra's own job order (for slurm/sweep.sbatch's array tasks).
- `pack`: a packed job's driver (slurm/pack.sbatch): several points side by side in one allocation,
  requeued together.
- `summary`: summary.csv and summary.png of a sweep dir, written when a sweep ends (a Hydra callback)
  or afterwards (`python scripts/summarize.py <sweep dir>`).
- `slurm`: the SLURM launcher (`hydra/launcher=slurm`), hydra-submitit-launcher with the template's
  guarantees; `optuna_sweeper`: Optuna searches (`hparams_search=...`) on Optuna's ask-and-tell API.

Nothing here imports torch at module level.
"""
