"""What a run leaves on disk and reads back, below the run and its callbacks: checkpoints (`checkpoints`),
the run's record (`records`: run.yaml, outcome.yaml) and its attempts (`attempts`: requeue budgets, cost)."""
