"""`SweepSummary` (hpctrain's hydra/default.yaml, `hydra.callbacks.summary`): a Hydra callback, not a
Lightning one. When a sweep (-m) ends it writes the sweep's summary (`hpctrain.runtime.sweeps.summary`)
and reports the points `skip_completed` skipped; the sweep's own state begins and ends with it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

from hpctrain.runtime import run_state
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.distributed import notify
from hpctrain.runtime.run.job import skipped
from hpctrain.runtime.sweeps.summary import report

log = logging.getLogger("hpctrain")


class SweepSummary(HydraCallback):
    """Hydra callback: when a sweep (-m) ends, write its summary (summary.csv, summary_groups.csv, summary.png)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_state.begin_sweep()  # nothing of an earlier sweep in this process (its skipped jobs)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        jobs = skipped()
        if jobs:
            log.info(
                "skip_completed: %d point(s) had completed in %s with the same config and were skipped (jobs %s)",
                len(jobs),
                sweep_dir,
                ", ".join(map(str, jobs)),
            )
        try:
            if sweep_dir.is_dir():
                settings = Settings.of(config)  # the sweep's, as each of its points checked them
                mode = settings.monitor.mode if settings.monitor is not None else None
                notify.sweep_ended(settings.notify, sweep_dir, report(sweep_dir).headline(mode))
        finally:
            run_state.end_sweep()
