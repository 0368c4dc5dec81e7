"""hpctrain's pytest plugin, for the template's suite and a project's alike (tests/conftest.py:
`pytest_plugins = ["hpctrain.testing.plugin"]`):

- `--model`, `--data`, `--override`: the pair the contract tests check (hpctrain.testing.contract);
  registered in a plugin because pytest reads command-line options only from plugins and the conftest
  files it loads before parsing the command line;
- `pair`, `contract`: the pair, and the pair composed, built and fitted as src/train.py does;
- `slurm_cluster`: a real two-node Slurm cluster on this machine for the session (hpctrain.testing.local_slurm),
  skipped with the reason where Slurm is not installed, an error under CI=true.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpctrain.testing.local_slurm import ClusterUnavailable, LocalSlurmCluster, missing_binaries

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("contract", "contract tests of a model x data pair (tests/contract)")
    # The default pair is quickstart's: every project has it, with or without the examples.
    group.addoption("--model", default="mnist_cnn", metavar="OPTION", help="a conf/model option (mnist_cnn)")
    group.addoption("--data", default="digits", metavar="OPTION", help="a conf/data option (digits)")
    group.addoption(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every contract check, as on the train.py command line; repeatable",
    )


def pytest_report_header(config: pytest.Config) -> str:
    # The pair's options as given (as `Pair` prints them), without importing hpctrain.testing.contract: it
    # imports Lightning, which the process that only hands tests to `pytest -n 2`'s workers never needs.
    options = [f"model={config.getoption('--model')}", f"data={config.getoption('--data')}"]
    return f"contract tests: {' '.join([*options, *config.getoption('--override')])}"


@pytest.fixture(scope="session")
def pair(request: pytest.FixtureRequest):
    from hpctrain.testing.contract import _pair

    return _pair(request.config)


@pytest.fixture
def contract(pair, tmp_path: Path):
    from hpctrain.testing.contract import Contract

    return Contract(pair, tmp_path)


PORTS = 15000  # slurm/job_env.sh: MASTER_PORT = 15000 + the job id modulo 15000


def first_job_id(worker: str | None = None, workers: int | None = None) -> int:
    """The first job id of this pytest-xdist worker's cluster: the workers split job_env.sh's 15000 ports
    (two workers: ids from 1 and from 7501), so two jobs of two workers never share a MASTER_PORT while
    each submits fewer than 15000 / workers (a session submits a few hundred)."""
    worker = worker or os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = workers or int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    number = worker.removeprefix("gw")
    index = int(number) if number.isdigit() else 0
    return 1 + PORTS // workers * index


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real two-node Slurm cluster (slurmctld + slurmd node1, node2) for the whole session; under
    pytest-xdist each worker starts its own, on ports of its own, so Slurm tests run side by side.

    Skipped where Slurm is not installed, except under CI=true, where a missing cluster is an error.
    """
    missing = missing_binaries()
    reason = (
        f"Slurm not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
        if missing
        else None
    )
    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), first_job_id=first_job_id())
    if reason is None:
        try:
            cluster.start()
        except ClusterUnavailable as err:
            reason = f"cannot start the local Slurm cluster: {err}"
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI=true requires the Slurm tests to run, but {reason}", pytrace=False)
        pytest.skip(reason)
    yield cluster
    cluster.stop()
