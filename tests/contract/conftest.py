"""The pair under contract and the template's own build path for it.

`--model`, `--data` and `--override` (registered in tests/conftest.py) name the pair; `contract`
composes it as `python src/train.py model=<m> data=<d> <overrides>` would, checks it with the
template's checks, and builds and fits it with `hpctrain.build`, on CPU and in this process. A mistake
the template recognises fails the test with the template's own sentence; an exception raised in the
pair's code keeps its traceback, which points into that code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import DictConfig
from pytorch_lightning import Callback, Trainer

from hpctrain.runtime.config.checks import check_config
from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.config.hydra_errors import describe_hydra_error
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.report import console
from hpctrain.runtime.run import build


@dataclass(frozen=True)
class Pair:
    model: str
    data: str
    overrides: tuple[str, ...] = ()

    @property
    def options(self) -> list[str]:
        """What the pair adds to a train.py command line."""
        return [f"model={self.model}", f"data={self.data}", *self.overrides]

    def __str__(self) -> str:
        return " ".join(self.options)


def _pair(config: pytest.Config) -> Pair:
    return Pair(
        config.getoption("--model"), config.getoption("--data"), tuple(config.getoption("--override"))
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"contract tests: {_pair(config)}"


@contextmanager
def template_errors_fail(pair: Pair) -> Iterator[None]:
    """A UserError (a mistake the template recognises) fails the test with its one sentence."""
    try:
        yield
    except UserError as err:
        # `from None`: the report shows the sentence once, without the UserError it replaces
        raise pytest.fail.Exception(f"{pair}: {err}", pytrace=False) from None


class Contract:
    """The pair, composed, built and fitted the way src/train.py does it, in `tmp_path`."""

    def __init__(self, pair: Pair, tmp_path: Path) -> None:
        self.pair = pair
        self.tmp_path = tmp_path

    def compose(self, *overrides: str, run: str = "run") -> DictConfig:
        """The pair's train config with outputs in tmp_path/<run>, then `overrides`, checked as train.py
        checks it. On CPU unless --override chooses another trainer; no logger, so nothing reaches a
        tracker configured in conf/local."""
        output_dir = self.tmp_path / run
        paths = [f"paths.output_dir={output_dir}", f"paths.log_dir={self.tmp_path}"]
        chosen = ["trainer=cpu", "~logger", *self.pair.options, *paths, "extras.print_config=false"]
        try:
            cfg = compose("train", [*chosen, *overrides])
        except Exception as err:
            sentence = describe_hydra_error(err, "train")
            if sentence is None:
                raise
            raise pytest.fail.Exception(f"{self.pair}: {sentence}", pytrace=False) from None
        with template_errors_fail(self.pair):
            check_config(cfg)
        return cfg

    def build(self, cfg: DictConfig, training: bool = True) -> build.Run:
        """Datamodule (its data checked), model and trainer, after the seeding train.py does."""
        console.apply_extras(cfg)  # as train.py: Lightning's notices that the template replaces are dropped
        with template_errors_fail(self.pair):
            build.configure_process(cfg)
            return build.run_objects(cfg, cfg.paths.output_dir, training=training)

    def trainer(self, cfg: DictConfig, training: bool = True) -> Trainer:
        """The trainer alone (src/eval.py's kind with training=False)."""
        with template_errors_fail(self.pair):
            return build.trainer(cfg, cfg.paths.output_dir, training=training)

    def fit(
        self, cfg: DictConfig, callbacks: Sequence[Callback] = (), ckpt_path: Path | None = None
    ) -> build.Run:
        """Build and fit as train.py does (from `ckpt_path` if given), with `callbacks` added."""
        run = self.build(cfg)
        run.trainer.callbacks.extend(callbacks)
        with template_errors_fail(self.pair):
            run.trainer.fit(run.model, run.datamodule, ckpt_path=ckpt_path, weights_only=True)
        return run

    def test(self, run: build.Run) -> None:
        """Test the fitted model as train.py does after fit (`test=true`), where it has a test_step."""
        with template_errors_fail(self.pair):
            if build.can_test(run.model, run.datamodule):
                run.trainer.test(run.model, run.datamodule)


@pytest.fixture(scope="session")
def pair(request: pytest.FixtureRequest) -> Pair:
    return _pair(request.config)


@pytest.fixture
def contract(pair: Pair, tmp_path: Path) -> Contract:
    return Contract(pair, tmp_path)
