"""An Optuna search as a Hydra sweeper, on Optuna's ask-and-tell API (`hparams_search=...`).

Why not hydra-optuna-sweeper: its releases pin Optuna 2.x, whose SQLite study storage does not work
with SQLAlchemy 2, which MLflow requires; a study that survives the launching process needs exactly
that storage. This sweeper is small because Optuna does the searching: it asks Optuna for trials,
launches them as Hydra jobs through whichever launcher is configured (local, or `hydra/launcher=slurm`),
and tells Optuna each job's value: the best `monitor.metric` of the run, maximised or minimised as
`monitor.mode` says. A job that fails is told as a failed trial, and the study goes on.

With `repeats: N` (above 1) each trial is N jobs launched together, with the same sampled values and
`seed=<seed + i>` or, with `repeat_over: data.fold`, `data.fold=i` (k-fold cross-validation, N =
`data.num_folds`); Optuna is told the mean of their values, and the trial records the N values, their
mean and standard deviation and its jobs as user attributes. A repeat that fails fails the trial: a mean
over the repeats that happened to succeed would favour settings that fail on some seeds or folds.

Search spaces are plain config (conf/hparams_search/*.yaml):

    params:
      model.optimizer.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
      data.batch_size: {type: categorical, choices: [32, 64, 128]}
      model.net.dropout: {type: float, low: 0.0, high: 0.7}
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.config.checks import check_folds
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.sweeps.groups import Stats, point_of

log = logging.getLogger(__package__.split(".")[0])

REPEAT_OVER = ("seed", "data.fold")  # what a trial's repeats may differ in (the summary averages over both)


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


@dataclass(frozen=True)
class Repeats:
    """How each trial runs: `count` jobs with the same sampled values, differing only in `over`, which
    takes `values` (the seeds or folds, one per job; none when count is 1: the trial is one job)."""

    count: int
    over: str
    values: tuple[int, ...] = ()

    def overrides(self) -> list[list[str]]:
        """Each job's own overrides, added to the trial's."""
        return [[f"{self.over}={value}"] for value in self.values] if self.values else [[]]


def trial_repeats(
    repeats: Any, over: Any, config: DictConfig, searched: Collection[str], given: Mapping[str, str]
) -> Repeats:
    """hydra.sweeper.repeats and repeat_over checked against the config, the search space (`searched`)
    and the keys given on the command line (`given`): the repeats' seeds count up from `seed`, their
    folds are 0 to data.num_folds - 1."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise UserError(
            f"hydra.sweeper.repeats={repeats!r} is not a positive integer; pass the number of runs per "
            "trial, e.g. hydra.sweeper.repeats=3 (1: one run per trial)."
        )
    if over not in REPEAT_OVER:
        raise UserError(
            f"hydra.sweeper.repeat_over={over!r} is neither seed nor data.fold; pass hydra.sweeper."
            "repeat_over=seed (a trial's runs differ in seed) or data.fold (they are the folds of k-fold "
            "cross-validation)."
        )
    if repeats == 1:
        return Repeats(1, over)
    kind = "seeds" if over == "seed" else "folds"
    for key in (over, "data.num_folds") if over == "data.fold" else (over,):
        if key in searched:
            raise UserError(
                f"hydra.sweeper.params searches {key}, but hydra.sweeper.repeats={repeats} runs each "
                f"trial over {kind} (hydra.sweeper.repeat_over={over}); drop {key} from the search space, "
                "or pass hydra.sweeper.repeats=1."
            )
    if over == "seed":
        seed = OmegaConf.select(config, "seed", default=None)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise UserError(
                f"hydra.sweeper.repeats={repeats} gives each trial the seeds seed to seed+{repeats - 1}, but "
                f"seed={seed!r} is not an integer; pass one, e.g. seed=12345."
            )
        return Repeats(repeats, over, tuple(range(seed, seed + repeats)))
    num_folds, fold = OmegaConf.select(config, "data.num_folds", default=None), given.get("data.fold")
    if fold is not None:
        raise UserError(
            f"data.fold={fold} is given, but hydra.sweeper.repeat_over=data.fold runs each trial on every "
            f"fold (0 to {repeats - 1}); leave data.fold out."
        )
    if num_folds is None:
        raise UserError(
            f"hydra.sweeper.repeat_over=data.fold runs each trial on folds 0 to {repeats - 1}, but "
            f"data.num_folds is not set; pass data.num_folds={repeats}."
        )
    check_folds(num_folds, 0)
    if num_folds != repeats:
        raise UserError(
            f"hydra.sweeper.repeats={repeats} but data.num_folds={num_folds}: with hydra.sweeper.repeat_over="
            f"data.fold a trial runs once per fold; pass hydra.sweeper.repeats={num_folds} (or "
            f"data.num_folds={repeats})."
        )
    return Repeats(repeats, over, tuple(range(repeats)))


def _value(result: Any) -> float | None:
    """A job's value for Optuna: its finite return value, or None (failed, or no value)."""
    value = result.return_value if result.status == JobStatus.COMPLETED else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _told_as(trial: Any) -> tuple[int, str | None]:
    """How many jobs, differing in what, an earlier trial of the study was the mean of (its user
    attributes; none: one job)."""
    for over in REPEAT_OVER:
        if over in trial.user_attrs:
            return len(trial.user_attrs[over]), over
    return 1, None


def tell(
    study: Any, trial: Any, repeats: Repeats, values: Sequence[float | None], jobs: Sequence[int]
) -> None:
    """Tell Optuna a trial's value: its job's, or the mean of its repeats' (recorded as the trial's user
    attributes with their seeds or folds, std and job numbers); a trial with a job without a value fails."""
    import optuna

    named = [f"{repeats.over}={r}" for r in repeats.values] or [""]  # a single job: not named
    if repeats.values:
        stats = Stats.of([v for v in values if v is not None])
        attrs = {
            repeats.over: list(repeats.values),
            "values": list(values),
            "mean": stats.mean,
            "std": stats.std,
            "jobs": list(jobs),
        }
        for key, attr in attrs.items():
            trial.set_user_attr(key, attr)
    if None in values:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        lost = [f"job {j} ({n})" for v, j, n in zip(values, jobs, named, strict=True) if v is None and n]
        log.warning(
            "trial %d: %s failed (no value%s); the study goes on",
            trial.number,
            trial.params,
            f" from {', '.join(lost)}" if lost else "",
        )
        return
    value = statistics.fmean(values)  # a single job's value as it is
    study.tell(trial, value)
    of = ", ".join(f"{n}: {v:.6g}" for n, v in zip(named, values, strict=True) if n)
    log.info("trial %d: %s -> %.6g%s", trial.number, trial.params, value, f", the mean of {of}" if of else "")


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
        repeats: int = 1,
        repeat_over: str = "seed",
    ) -> None:
        self.params = OmegaConf.to_container(params) if OmegaConf.is_config(params) else dict(params)
        self.n_trials, self.n_jobs = int(n_trials), max(1, int(n_jobs))
        self.direction, self.study_name, self.storage, self.seed = direction, study_name, storage, seed
        self.repeats, self.repeat_over = repeats, repeat_over  # checked in sweep(), against the config

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
        repeats = trial_repeats(self.repeats, self.repeat_over, self.config, searched, point_of(fixed))
        if repeats.values:  # the repeats' own values replace a given one (seed=7: the seeds count from 7)
            fixed = [a for a in fixed if a.lstrip("+~").partition("=")[0] != repeats.over]
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
        earlier = {_told_as(t) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
        if earlier - {(repeats.count, repeats.over if repeats.values else None)}:
            log.warning(
                "study %s holds trials told as means over other repeats than hydra.sweeper.repeats=%d "
                "(repeat_over=%s), so their values compare badly; continue it with the same repeats, or "
                "start a new study: hydra.sweeper.study_name=<name>",
                study.study_name,
                repeats.count,
                repeats.over,
            )
        done = launched = 0  # trials, jobs (the jobs' numbers, and their run dirs, count on across the sweep)
        while done < self.n_trials:
            trials = [study.ask(distributions) for _ in range(min(self.n_jobs, self.n_trials - done))]
            overrides = [
                [*fixed, *(f"{key}={value}" for key, value in trial.params.items()), *own]
                for trial in trials
                for own in repeats.overrides()
            ]
            results = self.launcher.launch(overrides, initial_job_idx=launched)
            for i, trial in enumerate(trials):
                first = launched + i * repeats.count
                jobs = range(first, first + repeats.count)
                tell(study, trial, repeats, [_value(results[j - launched]) for j in jobs], jobs)
            done += len(trials)
            launched += len(overrides)
        completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        best = {"direction": self._direction(), "trials": len(study.trials), "completed": len(completed)}
        if repeats.values:
            best.update(repeats=repeats.count, repeat_over=repeats.over)
        if completed:
            best.update(value=study.best_value, params=study.best_params)
            if repeats.values:
                attrs = study.best_trial.user_attrs
                best.update({key: attrs.get(key) for key in ("values", "std", "jobs")})
            log.info(
                "best: %s = %.6g with %s",
                OmegaConf.select(self.config, "monitor.metric"),
                study.best_value,
                study.best_params,
            )
        (sweep_dir / "optuna_best.yaml").write_text(yaml.safe_dump(best, sort_keys=False))
