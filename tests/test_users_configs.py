"""A user who clones the template and adds configs of their own keeps the template's suite green.

The tests that iterate over conf/ judge only what every option must satisfy (it composes, it builds, a
datamodule gives a batch, a model fits some data, an experiment runs a batch); what the template's own
batches hold is checked on its options by name. Here a clone of the project gets an option of the user's
in every group a user extends, among them three pairs whose batches are not `(inputs, targets)`
(tests/batch_shapes.py, as src/myproject/batch_shapes.py), and those tests run in the clone."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, ROOT, local_env

pytestmark = pytest.mark.slow

PACKAGE = "myproject.batch_shapes"

# conf/<group>/<name>.yaml of the user's: for each batch shape a datamodule, its model and an experiment.
USERS_CONFIGS = {
    "data/points.yaml": f"_target_: {PACKAGE}.PointsDataModule\ndim: 8\nbatch_size: 16\n",
    "data/two_views.yaml": f"_target_: {PACKAGE}.TwoViewsDataModule\ndim: 8\nnum_classes: 3\nbatch_size: 16\n",
    # keys a template model also reads (num_classes, image_shape): it "fits" by its keys, not by its batches
    "data/labelled_images.yaml": (
        f"_target_: {PACKAGE}.LabelledImagesDataModule\nnum_classes: 4\nimage_shape: [1, 8, 8]\nbatch_size: 16\n"
    ),
    "model/points_autoencoder.yaml": (
        "# @package _global_\n"
        f"model:\n  _target_: {PACKAGE}.PointsAutoEncoder\n  dim: ${{data.dim}}\n"
        "monitor:\n  metric: val/loss\n  mode: min\n"
    ),
    "model/two_views_classifier.yaml": (
        f"_target_: {PACKAGE}.TwoViewsClassifier\ndim: ${{data.dim}}\nnum_classes: ${{data.num_classes}}\n"
    ),
    "model/labelled_images_classifier.yaml": (
        f"_target_: {PACKAGE}.LabelledImagesClassifier\n"
        "num_classes: ${data.num_classes}\nimage_shape: ${data.image_shape}\n"
    ),
    **{
        f"experiment/{model}.yaml": (
            "# @package _global_\ndefaults:\n"
            f"  - override /data: {data}\n  - override /model: {model}\n  - override /trainer: cpu\n"
        )
        for data, model in [
            ("points", "points_autoencoder"),
            ("two_views", "two_views_classifier"),
            ("labelled_images", "labelled_images_classifier"),
        ]
    },
}
USERS_OPTIONS = sorted({Path(name).stem for name in USERS_CONFIGS})

# The template's tests that iterate over conf/: those that look at every option at once run whole, those
# parametrized by option run on the user's options.
AT_ONCE = [
    "tests/test_config.py::test_the_object_graph_has_its_groups",
    "tests/test_config.py::test_every_model_fits_some_data",
    "tests/test_matrix.py::test_the_cells_are_the_shipped_experiments_in_their_gpu_precision_as_the_page_lists",
    "tests/test_schema.py::test_every_config_file_validates_against_its_editor_schema",
]
BY_OPTION = [
    "tests/test_config.py::test_option_composes_and_passes_the_checks",
    "tests/test_config.py::test_data_option_yields_a_batch",
    "tests/test_config.py::test_experiment_runs_a_batch",
]


# A user's option in every group a user extends, beside the batch shapes' model, data and experiment
OPTION_IN_EVERY_GROUP = {
    **USERS_CONFIGS,
    "experiment/my_quickstart.yaml": (
        "# @package _global_\n# The quickstart, longer and with weight decay.\ndefaults:\n"
        "  - override /experiment: quickstart\ntrainer:\n  max_epochs: 40\nmodel:\n  optimizer:\n"
        "    weight_decay: 0.0001\n"
    ),
    "callbacks/swa.yaml": (ROOT / "docs" / "examples" / "swa.yaml").read_text(),  # your model's guide
    "logger/lightning_csv.yaml": (
        "# Lightning's own CSV logger, beside the template's.\nlightning_csv:\n"
        "  _target_: pytorch_lightning.loggers.CSVLogger\n  save_dir: ${paths.output_dir}\n  name: lightning\n"
    ),
    "trainer/my_cpu.yaml": "# One CPU process, a longer run.\ndefaults:\n  - cpu\nmax_epochs: 40\n",
    "hparams_search/my_search.yaml": (
        "# @package _global_\n# A smaller search: the learning rate only.\ndefaults:\n"
        "  - override /experiment: quickstart\n  - override /hydra/sweeper: optuna\nhydra:\n  sweeper:\n"
        "    n_trials: 5\n    storage: sqlite:///${paths.log_dir}/${task_name}/optuna.db\n    params:\n"
        "      model.optimizer.lr: {type: float, low: 1.0e-4, high: 0.03, log: true}\n"
    ),
}
EXTENDED_GROUPS = {"model", "data", "experiment", "callbacks", "logger", "trainer", "hparams_search"}


def _clone_with_an_option_in_every_group(project: Path) -> Path:
    """A copy of this checkout as a user's clone holds it (the files git would give them, and those not
    yet committed), with a config of the user's in every group they extend."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, project / name)
    shutil.copy(ROOT / "tests" / "batch_shapes.py", project / "src" / "myproject" / "batch_shapes.py")
    for name, text in OPTION_IN_EVERY_GROUP.items():
        (project / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (project / "conf" / name).write_text(text)
    git = ["git", "-c", "user.name=a user", "-c", "user.email=user@example.org"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "my configs"]):  # a clone is a repo
        subprocess.run([*git, *command], cwd=project, check=True, capture_output=True)
    return project


@pytest.mark.ondemand  # the suite checked against a user's conf/: the whole quick tier again (a minute)
def test_the_quick_tier_passes_in_a_clone_with_a_users_option_in_every_group(tmp_path: Path):
    """The whole quick tier, in a clone whose conf/ has an option of the user's in each group a user
    extends, three of them pairs whose batches are not `(inputs, targets)`: nothing the template
    compares (a reference page, a list of options) turns red, each test that iterates over conf/ judges
    the user's options too, and so do those of the slow tier that look at every option at once."""
    assert {name.split("/")[0] for name in OPTION_IN_EVERY_GROUP} == EXTENDED_GROUPS
    project = _clone_with_an_option_in_every_group(tmp_path / "clone")
    env = {
        **local_env(),
        "PYTHONPATH": str(project / "src"),  # the clone's hpctrain and myproject, not this checkout's
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # (its code root: the clone that carries that hpctrain)
    }
    # The quick tier whole, then the slow tier's tests among those that iterate over conf/: those that look
    # at every option at once whole, those parametrized by option on the user's options.
    by_option = " or ".join(test.split("::")[1] for test in BY_OPTION)
    keyword = f"not ({by_option}) or {' or '.join(USERS_OPTIONS)}"
    tiers = {"quick": ["-m", "not slow"], "slow": [*AT_ONCE, *BY_OPTION, "-m", "slow", "-k", keyword]}
    report = ""
    for tier, selection in tiers.items():
        result = subprocess.run(
            [PYTHON, "-m", "pytest", *selection, "-v", "-p", "no:cacheprovider"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        report += result.stdout + result.stderr
        failed = [line for line in report.splitlines() if line.startswith(("FAILED", "ERROR"))]
        none_slow = tier == "slow" and result.returncode == 5  # none of them is in the slow tier any more
        assert result.returncode == 0 or none_slow, "\n".join(failed) or report[-6000:]
    passed = set(re.findall(r"^(tests/\S+) PASSED", report, re.MULTILINE))
    assert set(AT_ONCE) <= passed, report[-3000:]
    for test in BY_OPTION:  # each ran on every option, the user's too
        assert any(name.startswith(f"{test}[") for name in passed), (test, report[-3000:])
    for name in OPTION_IN_EVERY_GROUP:  # each of the user's options was judged, and passed
        group, option = name.removesuffix(".yaml").split("/")
        assert re.search(rf"\[{re.escape(group)}={option}\] PASSED", report), (name, report[-2000:])
    for option in USERS_OPTIONS:  # the batch shapes' options, by each test parametrized by option
        assert any(re.search(rf"[\[=]{option}\]", test) for test in passed), (option, report[-3000:])
