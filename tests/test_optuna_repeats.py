"""An Optuna trial repeated over seeds or folds (hydra.sweeper.repeats, repeat_over): which jobs a trial
is, every setting that cannot work refused in one sentence, and what Optuna is told. No training here
(tests/test_sweeps.py runs a real search)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.sweeps.optuna_sweeper import Repeats, tell, trial_repeats


def _config(seed: object = 12345, num_folds: object = None) -> object:
    return OmegaConf.create({"seed": seed, "data": {"num_folds": num_folds, "fold": None}})


def test_one_repeat_is_one_job_with_nothing_added():
    repeats = trial_repeats(1, "seed", _config(seed=None), searched={"seed"}, given={"data.fold": "2"})
    assert repeats == Repeats(1, "seed") and repeats.overrides() == [[]]


def test_repeats_over_seeds_count_up_from_the_seed():
    repeats = trial_repeats(3, "seed", _config(seed=7), searched={"model.optimizer.lr"}, given={"seed": "7"})
    assert repeats.overrides() == [["seed=7"], ["seed=8"], ["seed=9"]]


def test_repeats_over_folds_are_every_fold():
    repeats = trial_repeats(4, "data.fold", _config(num_folds=4), searched=set(), given={})
    assert repeats.overrides() == [[f"data.fold={i}"] for i in range(4)]


@pytest.mark.parametrize(
    ("repeats", "over", "config", "searched", "given", "sentence"),
    [
        (0, "seed", _config(), set(), {}, "hydra.sweeper.repeats=0 is not a positive integer"),
        ("3", "seed", _config(), set(), {}, "hydra.sweeper.repeats='3' is not a positive integer"),
        (2, "lr", _config(), set(), {}, "hydra.sweeper.repeat_over='lr' is neither seed nor data.fold"),
        (
            2,
            "seed",
            _config(),
            {"seed"},
            {},
            "hydra.sweeper.params searches seed, but hydra.sweeper.repeats=2",
        ),
        (2, "seed", _config(seed=None), set(), {}, "seed=None is not an integer; pass one, e.g. seed=12345."),
        (2, "data.fold", _config(), set(), {}, "data.num_folds is not set; pass data.num_folds=2."),
        (
            3,
            "data.fold",
            _config(num_folds=5),
            set(),
            {},
            "hydra.sweeper.repeats=3 but data.num_folds=5: with hydra.sweeper.repeat_over=data.fold a trial "
            "runs once per fold; pass hydra.sweeper.repeats=5 (or data.num_folds=3).",
        ),
        (2, "data.fold", _config(num_folds=2), set(), {"data.fold": "1"}, "data.fold=1 is given, but"),
        (2, "data.fold", _config(num_folds=2), {"data.num_folds"}, {}, "params searches data.num_folds"),
        (2, "data.fold", _config(num_folds="x"), set(), {}, "data.num_folds='x' is not an integer"),
    ],
)
def test_settings_that_cannot_work_are_one_sentence(repeats, over, config, searched, given, sentence):
    with pytest.raises(UserError) as raised:
        trial_repeats(repeats, over, config, searched, given)
    assert sentence in str(raised.value) and "\n" not in str(raised.value)


def _study():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    return study, study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})


def test_a_trial_is_told_the_mean_of_its_repeats_and_records_them():
    study, trial = _study()
    tell(study, trial, Repeats(3, "seed", (5, 6, 7)), [0.5, 0.7, 0.9], range(6, 9))
    (told,) = study.trials
    assert told.value == pytest.approx(0.7)
    attrs = told.user_attrs
    assert attrs["seed"] == [5, 6, 7] and attrs["values"] == [0.5, 0.7, 0.9] and attrs["jobs"] == [6, 7, 8]
    assert attrs["mean"] == pytest.approx(0.7) and attrs["std"] == pytest.approx(0.2)


def test_a_failed_repeat_fails_the_trial_and_names_the_job(caplog):
    import optuna

    study, trial = _study()
    with caplog.at_level("WARNING", logger="hpctrain"):
        tell(study, trial, Repeats(2, "data.fold", (0, 1)), [0.5, None], [2, 3])
    (told,) = study.trials
    assert told.state == optuna.trial.TrialState.FAIL and told.user_attrs["values"] == [0.5, None]
    assert "failed (no value from job 3 (data.fold=1)); the study goes on" in caplog.text


def test_one_repeat_is_told_its_value_as_it_is_and_records_nothing():
    study, trial = _study()
    tell(study, trial, Repeats(1, "seed"), [0.1 + 0.2], [0])
    (told,) = study.trials
    assert told.value == 0.1 + 0.2 and told.user_attrs == {}
