"""Every option a user combines with a shipped experiment runs with it, on CPU: each `debug=` option, each
logger, each callbacks option, each optimizer and schedule, and the data options that apply to the
experiment's data (another dataset of the same shape, k-fold, loader workers). The sibling of
tests/test_matrix.py (experiments x strategies).

Hydra composes one config per run, so a cell is one run per `debug=` option and experiment; each cell
also carries one option of every other group, so that over an experiment's five cells every option
appears once. A cell runs the fewest steps its claim needs (the test after fit only where the option
changes it): it proves the combination works, not that it learns. docs/reference/combinations.md lists
the cells."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import EXAMPLES, ROOT, assert_ok, run_dirs, train
from tests.test_matrix import EXPERIMENTS


@dataclass(frozen=True)
class Cell:
    debug: str
    cheap: tuple[str, ...]  # the fewest steps that still show what the debug option does
    logger: str
    callbacks: str
    optimizer: str | None  # model/optimizer, model/scheduler (None: the experiment's own)
    scheduler: str | None


CELLS = (
    Cell("fdr", (), "csv", "none", "adam", "cosine"),  # fast_dev_run: one batch each, logs nothing
    # fractions of each split (a tiny split's fraction is one batch); two steps, the sanity check and the
    # test after fit read the validation and test fractions
    Cell(
        "limit",
        ("trainer.max_epochs=1", "trainer.max_steps=2"),
        "tensorboard",
        "[model_checkpoint,early_stopping,progress]",
        "adamw",
        "none",
    ),
    # Lightning rebuilds both loaders unshuffled; one epoch of its 3 batches (+ 3 validation batches)
    Cell(
        "overfit",
        ("trainer.max_epochs=1", "test=false"),
        "many",
        "[lr_monitor,model_summary,throughput]",
        "sgd",
        "onecycle",
    ),
    Cell(
        "profiler",
        (
            "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0",
            "test=false",
        ),
        "mlflow",
        "[model_checkpoint,performance]",
        "adadelta",
        "step",
    ),
    # its schedule: 1 step skipped, 1 warm-up, 3 recorded (the cheat sheet's max_steps=20, shortened)
    Cell(
        "trace",
        (
            "trainer.max_steps=5",
            "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0",
            "test=false",
        ),
        "wandb",
        "default",
        None,
        None,
    ),
)

# The data options that apply to each experiment's data, one per cell in order (the rest of its cells run
# the experiment's own data): another dataset of the same shape, k-fold, loader workers.
SHARDS = (
    "data=shards",
    "data.root=${paths.data_dir}/digits_shards",
    "data.num_classes=10",
    "data.image_shape=[1,28,28]",
)
DATA: dict[str, tuple[tuple[str, ...], ...]] = {
    "quickstart": (("data=plain_digits",), ("data.num_folds=3", "data.fold=1"), ("data.num_workers=1",)),
    "mnist_cnn": (("data=fashion_mnist",), ("data.num_folds=3", "data.fold=2"), ("data.num_workers=1",)),
    "fashion_mnist": (("data=mnist",), (), ("data.num_workers=1",)),
    "cifar10_resnet18": ((), ("data.num_folds=3", "data.fold=0"), ("data.num_workers=1",)),
    "image_folder_demo": (SHARDS, ("data.num_folds=3", "data.fold=0"), ("data.num_workers=1",)),
    "finetune_digits": ((), ("data.num_folds=3", "data.fold=0"), ("data.num_workers=1",)),
    "char_transformer": ((), ("data.num_folds=3", "data.fold=2"), ("data.num_workers=1",)),
}
# Smaller splits where an experiment's would make a cell slow (only their size changes).
SMALLER = {"char_transformer": ("data.val_fraction=0.0005", "data.test_fraction=0.0005")}


# The costly debug options (a profiler, a trace) run in CI with every third experiment, in turn; with the
# others on demand (pytest --ondemand). The cheap cells, which carry the data options, all run in CI.
COSTLY = ("profiler", "trace")


def _cells() -> list[tuple[str, int]]:
    return [(experiment, index) for experiment in EXPERIMENTS for index in range(len(CELLS))]


def _in_ci(experiment: str, index: int) -> bool:
    debug = CELLS[index].debug
    return debug not in COSTLY or list(EXPERIMENTS).index(experiment) % 3 == COSTLY.index(debug)


def _params() -> list:
    return [
        pytest.param(e, i, id=f"{e}-{CELLS[i].debug}", marks=() if _in_ci(e, i) else pytest.mark.ondemand)
        for e, i in _cells()
    ]


def test_every_option_of_every_group_is_in_a_cell():
    """The cells cover every option the template ships in the groups a user combines with an experiment."""
    shipped = {
        group: {p.stem for p in (ROOT / "src" / "hpctrain" / "conf" / group).glob("*.yaml")}
        for group in ("debug", "logger", "callbacks")
    }
    shipped["model/optimizer"] = {p.stem for p in (ROOT / "conf" / "model" / "optimizer").glob("*.yaml")}
    shipped["model/scheduler"] = {p.stem for p in (ROOT / "conf" / "model" / "scheduler").glob("*.yaml")}
    covered = {
        "debug": {c.debug for c in CELLS},
        "logger": {c.logger for c in CELLS},
        "callbacks": {name for c in CELLS for name in c.callbacks.strip("[]").split(",")},
        "model/optimizer": {c.optimizer for c in CELLS} - {None},
        "model/scheduler": {c.scheduler for c in CELLS} - {None},
    }
    for group, options in shipped.items():
        assert options <= covered[group], (group, sorted(options - covered[group]))
    assert set(DATA) == set(EXPERIMENTS) and all(len(d) <= len(CELLS) for d in DATA.values())


def test_the_combinations_page_lists_the_cells():
    page = (ROOT / "docs" / "reference" / "combinations.md").read_text()
    rows = re.findall(
        r"^\| `debug=(\w+)` \| `([\w]+)` \| `([^`]+)` \| (`\w+`|the experiment's) \| (`\w+`|the experiment's) \|",
        page,
        re.M,
    )
    listed = [(d, lg, cb, o.strip("`"), sc.strip("`")) for d, lg, cb, o, sc in rows]
    own = "the experiment's"
    assert listed == [(c.debug, c.logger, c.callbacks, c.optimizer or own, c.scheduler or own) for c in CELLS]


@pytest.fixture(scope="module")
def digits_checkpoint(quickstart_run: Path) -> Path:
    """A quickstart checkpoint for finetune_digits' init_from (the session's)."""
    return quickstart_run / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES, reason="the examples' experiments are not in this project")
@pytest.mark.parametrize(("experiment", "index"), _params())
def test_an_option_combined_with_a_shipped_experiment_runs(
    experiment: str, index: int, data_dir: Path, digits_checkpoint: Path, tmp_path: Path
):
    cell = CELLS[index]
    data = DATA[experiment]
    overrides = [
        f"experiment={experiment}",
        f"debug={cell.debug}",
        f"logger={cell.logger}",
        f"callbacks={cell.callbacks}",
        *([f"model/optimizer={cell.optimizer}"] if cell.optimizer else []),
        *([f"model/scheduler={cell.scheduler}"] if cell.scheduler else []),
        f"paths.data_dir={data_dir}",
        *EXPERIMENTS[experiment],
        *SMALLER.get(experiment, ()),
        *(data[index] if index < len(data) else ()),
        *cell.cheap,
        "trainer.log_every_n_steps=1",
    ]
    if experiment == "finetune_digits":
        overrides.append(f"init_from.path={digits_checkpoint}")
    result = train(tmp_path, *overrides, timeout=300)
    assert_ok(result)
    (run,) = run_dirs(tmp_path, task="debug")  # every debug option names its runs' task "debug"
    outcome = yaml.safe_load((run / "outcome.yaml").read_text())
    assert outcome["status"] == "completed", outcome
    if cell.debug == "limit":
        assert outcome["test"], outcome  # the test after fit read its fraction of the test split
    if cell.debug == "profiler":
        assert "Profiler Report" in result.stdout
    if cell.debug == "trace":
        assert any((run / "traces").iterdir())
    logged = {
        "tensorboard": any((run / "tensorboard").glob("events.out.tfevents.*")),
        "many": any((run / "tensorboard").glob("events.out.tfevents.*")) and (run / "metrics.csv").is_file(),
        "mlflow": (run / "mlflow.db").is_file(),
        "wandb": (run / "wandb").is_dir(),
    }
    assert logged.get(cell.logger, True), f"logger={cell.logger} left nothing in {run}"
