"""Every combination the template ships runs: each experiment under trainer=cpu, ddp_cpu and fsdp_cpu, fit
and the test after fit with its own callbacks on, a resume under each strategy, and FSDP2's sharding by
`auto` and by a named block class, for the template's models and for a plain user module without
configure_model. A cell trains two batches: it proves the combination works, not that it learns (other
tests do that). docs/reference/combinations.md lists the same cells."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hpctrain.runtime.run.checkpoints import reading
from tests.differential.cases import user_overrides
from tests.helpers import EXAMPLES, ROOT, assert_ok, run_dirs, train

pytestmark = pytest.mark.slow

STRATEGIES = ("cpu", "ddp_cpu", "fsdp_cpu")
TINY = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=1",
    "trainer.log_every_n_steps=1",
)
# What each experiment needs besides the strategy to run two batches in seconds on CPU (its own
# callbacks stay on): smaller batches, and the digits' checkpoint a fine-tuning starts from.
EXPERIMENTS: dict[str, tuple[str, ...]] = {
    "quickstart": ("data.batch_size=16",),
    "mnist_cnn": ("data.batch_size=16",),
    "fashion_mnist": ("data.batch_size=16",),
    "cifar10_resnet18": ("data.batch_size=8", "trainer.precision=32-true"),  # bf16 is emulated on CPUs
    "image_folder_demo": ("data.batch_size=16",),
    "finetune_digits": ("data.batch_size=16",),
    "char_transformer": ("data.batch_size=8", "data.block_size=32", "callbacks.text_sample.length=4"),
}


def test_the_cells_are_the_shipped_experiments_the_combinations_page_lists():
    """The template's own experiments, by name: a user's experiment added to conf/experiment/ is not a cell
    (tests/test_config.py runs a batch of it; the contract tests check its pair). A new experiment of the
    template's gets a row on the page, and so a cell."""
    shipped = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    assert not EXAMPLES or set(EXPERIMENTS) <= shipped, sorted(set(EXPERIMENTS) - shipped)
    page = (ROOT / "docs" / "reference" / "combinations.md").read_text()
    assert re.findall(r"^\| `(\w+)` \|", page, re.MULTILINE) == list(EXPERIMENTS)


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = tmp_path_factory.mktemp("digits")
    assert_ok(train(logs, "experiment=quickstart", "trainer=cpu", *TINY, "test=false"))
    return run_dirs(logs)[0] / "checkpoints" / "last.ckpt"


def _ran(log_dir: Path, result, strategy: str) -> Path:
    assert_ok(result)
    (run,) = run_dirs(log_dir)
    outcome = yaml.safe_load((run / "outcome.yaml").read_text())
    assert outcome["status"] == "completed" and outcome["test"], outcome  # fit, then the test after fit
    assert (run / "checkpoints" / "last.ckpt").exists()
    if strategy == "fsdp_cpu":
        assert "FSDP2: " in result.stdout and "block(s) sharded over 2 process(es)" in result.stdout
    return run


CELLS = [(e, s) for e in EXPERIMENTS for s in STRATEGIES]


@pytest.mark.skipif(not EXAMPLES, reason="the examples' experiments are not in this project")
@pytest.mark.parametrize("experiment, strategy", CELLS, ids=[f"{e}-{s}" for e, s in CELLS])
def test_a_shipped_experiment_fits_and_tests(
    experiment: str, strategy: str, data_dir: Path, digits_checkpoint: Path, tmp_path: Path
):
    """Fit and the test after fit; the quickstart's cell then resumes from its last.ckpt for a second epoch
    (a resume under each strategy)."""
    extra = [f"init_from.path={digits_checkpoint}"] if experiment == "finetune_digits" else []
    common = (f"experiment={experiment}", f"trainer={strategy}", f"paths.data_dir={data_dir}", *TINY)
    result = train(tmp_path / "first", *common, *EXPERIMENTS[experiment], *extra, timeout=300)
    run = _ran(tmp_path / "first", result, strategy)
    if experiment == "char_transformer":
        assert "sample after epoch 0:" in result.stdout  # the text sample ran on every rank, rank 0 logged
    if experiment != "quickstart":
        return
    last = run / "checkpoints" / "last.ckpt"
    resumed = train(
        tmp_path / "resumed", *common, *EXPERIMENTS[experiment], "trainer.max_epochs=2", f"ckpt_path={last}"
    )
    again = _ran(tmp_path / "resumed", resumed, strategy)
    assert f"starting from {last}" in resumed.stdout
    assert reading.read(again / "checkpoints" / "last.ckpt", weights=False)["global_step"] == 4


SHARDS = {
    "the CNN, named": ("experiment=quickstart", "dist.fsdp.shard=[Conv2d]"),
    "the Transformer, named": (
        "experiment=char_transformer",
        "dist.fsdp.shard=[Block]",
        *EXPERIMENTS["char_transformer"],
    ),
    "a plain module, auto": (*user_overrides("LitClassifier"), "dist.fsdp.shard=auto"),
    "a plain module, named": (*user_overrides("LitClassifier"), "dist.fsdp.shard=[Linear]"),
}


@pytest.mark.parametrize("case", SHARDS)
def test_fsdp2_shards_by_auto_and_by_a_named_class_and_tests_after_fit(case: str, tmp_path: Path):
    """(`auto` for the template's models: their cells above.) The test after fit as well: Lightning calls
    configure_model again for it, and hpctrain's own configure_model must not be taken for the module's
    (it was: 'would shard it again')."""
    result = train(
        tmp_path, *SHARDS[case], "trainer=fsdp_cpu", *TINY, env={"PYTHONPATH": str(ROOT)}, timeout=300
    )
    _ran(tmp_path, result, "fsdp_cpu")
    if "named" in case:
        named = SHARDS[case][-1 if "Transformer" not in case else 1].split("[")[1].rstrip("]")
        assert f"({named})" in result.stdout
