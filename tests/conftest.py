from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import loaded_configs
from tests.helpers import (
    assert_ok,
    run_dirs,
    train,
    write_cifar10_batches,
    write_mnist_raw,
    write_small_image_data,
)
from tests.once import made_once

pytest_plugins = ["hpctrain.testing.plugin"]  # the contract tests' options and fixtures, slurm_cluster

# Two workers on two cores run two processes at once, each with as many intra-op threads as the machine
# has CPUs (num_threads: auto). OpenMP's threads spin while they wait for each other, and a spinning
# thread takes the core from the other worker's process: a training step took 3 to 10 times its time
# (the char Transformer's test: 27 s of CPU instead of 4). Waiting threads that sleep lose nothing of
# the numbers, only the spin. Set before any process or OpenMP runtime starts; every process the tests
# start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config: pytest.Config) -> None:
    """Where tests run (not in the process that only hands them to `pytest -n`'s workers), each config
    file Hydra reads is read once (tests/loaded_configs.py), before collection composes the first; and
    Lightning's notices that hpctrain's runs drop (`quiet_lightning`: the srun hint, a torch deprecation
    inside Lightning) are dropped in the tests' own processes too. A warning a worker reports is rebuilt
    in the main process by importing its category's module: one of Lightning's costs it 5 s of CPU,
    which the two workers share two cores with."""
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        from hpctrain.runtime.report.console import quiet_lightning

        loaded_configs.install()
        quiet_lightning()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A worker of `pytest -n` ends here, its results already with the main process, without tearing down
    its interpreter (tests/preload.py's runs end the same way): the main process waits for both workers to
    end before it reports."""
    if hasattr(config, "workerinput"):
        from tests.preload import end_without_teardown

        end_without_teardown(0)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir holding every dataset the configs read from files, written in their official formats
    (MNIST and FashionMNIST as torchvision's raw idx files, made of real handwritten digits; CIFAR-10 as
    its python-pickle batches, made of class-dependent patterns; 200 digits as an image folder in
    digits_images/ and as its shards in digits_shards/)."""
    data_dir = tmp_path_factory.mktemp("data")
    write_mnist_raw(data_dir, "MNIST")
    write_mnist_raw(data_dir, "FashionMNIST")
    write_cifar10_batches(data_dir)
    write_small_image_data(data_dir)
    return data_dir


@pytest.fixture(scope="session")
def mnist_dir(data_dir: Path) -> Path:
    return data_dir


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ondemand",
        action="store_true",
        help="also run the cells marked ondemand (the matrices' cells beyond those CI runs)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, by the seconds each took when the suite was last measured
    (tests/durations.json, written by `make durations`); a test not measured yet by its tier's typical
    time (Slurm tests wait for nodes, credentials and requeues). Under pytest-xdist (`-n 2 --dist
    worksteal`, the README's test command) the longest start first and the quick ones fill the gaps at
    the end; a worker that runs out takes half of the other's queue, so both finish at about the same
    time. Ties keep the collection order. Cells marked `ondemand` are skipped unless `--ondemand` is given."""
    if not config.getoption("--ondemand"):
        on_demand = pytest.mark.skip(reason="a cell run on demand: pytest --ondemand (CI runs the others)")
        for item in items:
            if item.get_closest_marker("ondemand"):
                item.add_marker(on_demand)
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -measured.get(item.nodeid, TYPICAL_SECONDS[tier(item)]))  # stable


DURATIONS = Path(__file__).parent / "durations.json"
TYPICAL_SECONDS = {"slurm": 30.0, "slow": 8.0, "quick": 0.1}  # long for its tier: a new test starts early

TIERS = ("slurm", "slow", "quick")


def tier(item: pytest.Item) -> str:
    if "slurm_cluster" in getattr(item, "fixturenames", ()):
        return "slurm"
    return "slow" if item.get_closest_marker("slow") else "quick"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test's tier and worker in the JUnit XML file (`make durations`: scripts/dev/suite_durations.py)."""
    item.user_properties += [("tier", tier(item)), ("worker", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small trained run dir (quickstart: the classic CNN on the bundled digits, one epoch of five
    batches, tested), trained once per session: the export tests and the hostile-folder tests read it."""
    from tests.helpers import assert_ok, run_dirs, train

    log_dir = tmp_path_factory.mktemp("trained_quickstart")
    assert_ok(
        train(
            log_dir,
            "experiment=quickstart",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=5",
            "trainer.limit_val_batches=2",
            timeout=300,
        )
    )
    (run,) = run_dirs(log_dir)
    return run


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits as an image folder (1,797 PNG and JPEG files), written once per session."""
    from tests.helpers import write_image_folder

    return write_image_folder(tmp_path_factory.mktemp("image_folder") / "digits")


@pytest.fixture(scope="session")
def digit_shards(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards of `image_folder`, made by scripts/make_shards.py (a few shards per split)."""
    from tests.helpers import make_shards

    out = tmp_path_factory.mktemp("shards") / "digits-shards"
    made = make_shards(image_folder, out, "--shard-mb", "0.1", "--workers", "2")
    assert made.returncode == 0, made.stdout[-3000:]
    return out


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of `python src/train.py experiment=quickstart`, the README's first run, whole (25
    epochs), made once for the session whichever worker asks first; what it printed is in its train.log.
    The tests that read it (its accuracy, its checkpoints for eval, fine-tuning and export) write
    nowhere in it."""

    def quickstart(log_dir: Path) -> None:
        assert_ok(train(log_dir, "experiment=quickstart"))

    (run,) = run_dirs(made_once(tmp_path_factory, "quickstart", quickstart))
    return run
