"""An Optuna search as a Hydra sweeper, on Optuna's ask-and-tell API (`hparams_search=...`).

Why not hydra-optuna-sweeper: its releases pin Optuna 2.x, whose SQLite study storage does not work
with SQLAlchemy 2, which MLflow requires; a study that survives the launching process needs exactly
that storage. This sweeper is small because Optuna does the searching: it asks Optuna for trials,
launches them as Hydra jobs through whichever launcher is configured (local, or `hydra/launcher=slurm`),
and tells Optuna each job's value: the best `monitor.metric` of the run, maximised or minimised as
`monitor.mode` says. A job that fails is told as a failed trial, and the study goes on.

Search spaces are plain config (conf/hparams_search/*.yaml):

    params:
      model.optimizer.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
      data.batch_size: {type: categorical, choices: [32, 64, 128]}
      model.net.dropout: {type: float, low: 0.0, high: 0.7}
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.errors import UserError

log = logging.getLogger(__package__.split(".")[0])


def distribution(key: str, spec: Mapping[str, Any]) -> Any:
    import optuna.distributions as d

    kind = spec.get("type")
    if kind == "float":
        return d.FloatDistribution(float(spec["low"]), float(spec["high"]), log=bool(spec.get("log", False)))
    if kind == "int":
        return d.IntDistribution(int(spec["low"]), int(spec["high"]), log=bool(spec.get("log", False)))
    if kind == "categorical":
        return d.CategoricalDistribution(list(spec["choices"]))
    raise UserError(
        f"hydra.sweeper.params.{key}.type={kind} is not float, int or categorical; e.g. "
        f"{{type: float, low: 1.0e-4, high: 0.1, log: true}}."
    )


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        params: Mapping[str, Any],
        n_trials: int = 20,
        n_jobs: int = 1,
        direction: str | None = None,
        study_name: str | None = None,
        storage: str | None = None,
        seed: int | None = None,
    ) -> None:
        self.params = OmegaConf.to_container(params) if OmegaConf.is_config(params) else dict(params)
        self.n_trials, self.n_jobs = int(n_trials), max(1, int(n_jobs))
        self.direction, self.study_name, self.storage, self.seed = direction, study_name, storage, seed

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _direction(self) -> str:
        if self.direction:
            return self.direction
        mode = OmegaConf.select(self.config, "monitor.mode", default="max")
        return "maximize" if mode == "max" else "minimize"

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        if not self.params:
            raise UserError(
                "hydra.sweeper.params is empty: give the search space (conf/hparams_search/*.yaml)."
            )
        searched = set(self.params)
        fixed = [a for a in arguments if a.split("=", 1)[0].lstrip("+~") not in searched]
        if any("," in a.split("=", 1)[-1] for a in fixed if not a.startswith("hydra")):
            raise UserError(
                "an Optuna search takes single values on the command line; put ranges in hydra.sweeper.params."
            )
        distributions = {key: distribution(key, spec) for key, spec in self.params.items()}
        if self.storage and str(self.storage).startswith("sqlite:///"):
            Path(str(self.storage).removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        sampler = optuna.samplers.TPESampler(seed=self.seed)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            direction=self._direction(),
            sampler=sampler,
            load_if_exists=True,
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        done = 0
        while done < self.n_trials:
            trials = [study.ask(distributions) for _ in range(min(self.n_jobs, self.n_trials - done))]
            overrides = [
                [*fixed, *(f"{key}={value}" for key, value in trial.params.items())] for trial in trials
            ]
            results = self.launcher.launch(overrides, initial_job_idx=done)
            for trial, result in zip(trials, results, strict=True):
                value = result.return_value if result.status == JobStatus.COMPLETED else None
                if isinstance(value, (int, float)) and math.isfinite(value):
                    study.tell(trial, float(value))
                    log.info("trial %d: %s -> %.6g", trial.number, trial.params, value)
                else:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    log.warning(
                        "trial %d: %s failed (no value); the study goes on", trial.number, trial.params
                    )
            done += len(trials)
        completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        best = {"direction": self._direction(), "trials": len(study.trials), "completed": len(completed)}
        if completed:
            best.update(value=study.best_value, params=study.best_params)
            log.info(
                "best: %s = %.6g with %s",
                OmegaConf.select(self.config, "monitor.metric"),
                study.best_value,
                study.best_params,
            )
        (sweep_dir / "optuna_best.yaml").write_text(yaml.safe_dump(best, sort_keys=False))
