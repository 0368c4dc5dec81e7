"""One job of a sweep (`python src/train.py -m ...`): a failure ends the job, not the sweep."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hpctrain.runtime.distributed import cluster, watchdog
from hpctrain.runtime.errors import UserError

log = logging.getLogger(__package__.split(".")[0])


def in_multirun() -> bool:
    """Whether this process runs the jobs of a sweep (not a DDP child rank started by one of them)."""
    return HydraConfig.get().mode == RunMode.MULTIRUN and cluster.launcher() != cluster.CHILD


def run_job(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Run `task(cfg)`. In a sweep, a job that fails (its one-sentence error, or a crash of any of its
    ranks) returns None instead of ending the sweep: its run dir's outcome.yaml says why, and the
    sweep's summary.csv lists it. Outside a sweep, failures end the process as usual."""
    if not in_multirun():
        return task(cfg)
    if cluster.launcher() == cluster.TORCHRUN:
        raise UserError(
            "a sweep (-m) under torchrun would run every point in every worker; run the sweep without "
            "torchrun (DDP with trainer.devices, Lightning starts the local ranks), as SLURM jobs "
            "(hydra/launcher=slurm), or one torchrun command per point."
        )
    watchdog.in_sweep()
    job = HydraConfig.get().job.num
    try:
        return task(cfg)
    except SystemExit as err:
        if err.code == 128 + signal.SIGTERM:
            raise  # the sweep itself was told to stop
        if err.code not in (0, None):
            log.error("job %s failed (exit status %s); the sweep goes on", job, err.code)
        return None
    except KeyboardInterrupt:
        if watchdog.take_verdict() is None:
            raise  # Ctrl-C: stop the sweep
        log.error("job %s failed (one of its ranks died); the sweep goes on", job)
        return None
    except Exception as err:
        log.error("job %s failed (%s); the sweep goes on", job, type(err).__name__)
        return None
