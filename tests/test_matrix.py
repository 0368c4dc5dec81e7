"""Every combination the template ships runs as a GPU node would run it: each experiment under trainer=cpu,
ddp_cpu and fsdp_cpu (the stand-ins of trainer=gpu, ddp and fsdp) in the precision its GPU recipe uses
(bf16-mixed is emulated on CPUs), fit and the test after fit with its own callbacks on, a resume under each
strategy; the options users switch on (gradient clipping, accumulation, compile, activation checkpointing,
tensor parallelism where a plan ships) under each strategy that offers them; FSDP2's sharding by `auto` and
by a named block class; and the combinations that cannot work, refused in one sentence before the first
step. A cell trains two or three batches of a few samples: it proves the combination works, not that it
learns (other tests do that). docs/reference/combinations.md lists the same cells."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

from hpctrain.runtime.config.checks import check_config
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import reading
from tests import preload
from tests.differential.cases import user_overrides
from tests.helpers import EXAMPLES, ROOT, assert_ok, compose_train, run_dirs, train

pytestmark = pytest.mark.slow

STRATEGIES = ("cpu", "ddp_cpu", "fsdp_cpu")
ON_GPUS = {"cpu": "gpu", "ddp_cpu": "ddp", "fsdp_cpu": "fsdp"}  # what each strategy stands in for
TINY = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=1",
    "trainer.log_every_n_steps=1",
)
# What each experiment needs besides the strategy to run two batches in seconds on CPU (its own
# callbacks stay on): batches of a few samples, and the digits' checkpoint a fine-tuning starts from.
EXPERIMENTS: dict[str, tuple[str, ...]] = {
    "quickstart": ("data.batch_size=4",),
    "mnist_cnn": ("data.batch_size=4",),
    "fashion_mnist": ("data.batch_size=4",),
    "cifar10_resnet18": ("data.batch_size=2",),  # BatchNorm: under FSDP2 in bf16, its layers stay float32
    "image_folder_demo": ("data.batch_size=4",),
    "finetune_digits": ("data.batch_size=4",),
    "char_transformer": ("data.batch_size=4", "data.block_size=32", "callbacks.text_sample.length=4"),
}
RESUMED = ("quickstart",)  # a resume under each strategy, in the precision of its GPU recipe


@functools.cache
def gpu_precision(experiment: str, strategy: str) -> str:
    """The precision `experiment` trains in under the GPU trainer `strategy` stands in for (the experiment's
    own, else the trainer's: bf16-mixed under trainer=fsdp)."""
    cfg = compose_train(
        ROOT / "logs", ROOT / "data", f"experiment={experiment}", f"trainer={ON_GPUS[strategy]}"
    )
    return str(cfg.trainer.precision)


def _page() -> str:
    return (ROOT / "docs" / "reference" / "combinations.md").read_text()


def _rows(heading: str) -> dict[str, list[str]]:
    """The table under `heading` on the combinations page: its first cell (backticks off) -> the others."""
    section = _page().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    rows = [line.strip().strip("|").split(" | ") for line in lines]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_the_cells_are_the_shipped_experiments_in_their_gpu_precision_as_the_page_lists():
    """The template's own experiments, by name: a user's experiment added to conf/experiment/ is not a cell
    (tests/test_config.py runs a batch of it; the contract tests check its pair). A new experiment of the
    template's gets a row on the page, and so a cell; each cell of the page names the precision the
    experiment's GPU recipe trains in."""
    shipped = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    assert not EXAMPLES or set(EXPERIMENTS) <= shipped, sorted(set(EXPERIMENTS) - shipped)
    assert re.findall(r"^\| `(\w+)` \|", _page(), re.MULTILINE)[: len(EXPERIMENTS)] == list(EXPERIMENTS)
    rows = _rows("Experiments and strategies")
    for experiment in EXPERIMENTS:
        for strategy, cell in zip(STRATEGIES, rows[experiment], strict=True):
            assert cell.startswith(gpu_precision(experiment, strategy) + ":"), (experiment, strategy, cell)
            assert ("resume" in cell) == (experiment in RESUMED), cell


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = tmp_path_factory.mktemp("digits")
    assert_ok(train(logs, "experiment=quickstart", "trainer=cpu", *TINY, "test=false"))
    return run_dirs(logs)[0] / "checkpoints" / "last.ckpt"


def _ran(log_dir: Path, result, strategy: str, data_parallel: int = 2) -> Path:
    assert_ok(result)
    (run,) = run_dirs(log_dir)
    outcome = yaml.safe_load((run / "outcome.yaml").read_text())
    assert outcome["status"] == "completed" and outcome["test"], outcome  # fit, then the test after fit
    assert (run / "checkpoints" / "last.ckpt").exists()
    if strategy == "fsdp_cpu":
        assert f"block(s) sharded over {data_parallel} process(es)" in result.stdout
    return run


CELLS = [(e, s) for e in EXPERIMENTS for s in STRATEGIES]


def _train_once_more_if_hung(log_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """A cell's fit, run once more in its emptied folder if it outlived its timeout, the first run's
    stacks given as a warning: a cell proves that a combination works, and one hang seen once in CI in a
    few hundred cells (image_folder_demo under ddp_cpu, not reproduced in 100 runs here) must say where
    it was without failing the suite; a second hang fails the cell with its stacks."""
    try:
        return train(log_dir, *overrides, timeout=300)
    except preload.Hung as hung:
        warnings.warn(f"a matrix cell hung once and runs again: {hung}", stacklevel=2)
        shutil.rmtree(log_dir, ignore_errors=True)
        return train(log_dir, *overrides, timeout=300)


@pytest.mark.skipif(not EXAMPLES, reason="the examples' experiments are not in this project")
@pytest.mark.parametrize("experiment, strategy", CELLS, ids=[f"{e}-{s}" for e, s in CELLS])
def test_a_shipped_experiment_fits_and_tests_in_its_gpu_precision(
    experiment: str, strategy: str, data_dir: Path, digits_checkpoint: Path, tmp_path: Path
):
    """Fit and the test after fit in the precision of the GPU recipe; the quickstart's cell then resumes
    from its last.ckpt for a second epoch (a resume under each strategy)."""
    precision = gpu_precision(experiment, strategy)
    extra = [f"init_from.path={digits_checkpoint}"] if experiment == "finetune_digits" else []
    common = (
        f"experiment={experiment}",
        f"trainer={strategy}",
        f"trainer.precision={precision}",
        f"paths.data_dir={data_dir}",
        *TINY,
        *EXPERIMENTS[experiment],
    )
    result = _train_once_more_if_hung(tmp_path / "first", *common, *extra)
    run = _ran(tmp_path / "first", result, strategy)
    if strategy == "fsdp_cpu" and precision == "bf16-mixed":
        assert "gathered and computed in bfloat16" in result.stdout
        if experiment == "cifar10_resnet18":
            assert "norm layer(s) kept in float32" in result.stdout  # BatchNorm: its own float32 units
    if experiment == "char_transformer":
        assert "sample after epoch 0:" in result.stdout  # the text sample ran on every rank, rank 0 logged
    if experiment not in RESUMED:
        return
    last = run / "checkpoints" / "last.ckpt"
    resumed = train(tmp_path / "resumed", *common, "trainer.max_epochs=2", f"ckpt_path={last}", timeout=300)
    again = _ran(tmp_path / "resumed", resumed, strategy)
    assert f"starting from {last}" in resumed.stdout
    assert reading.read(again / "checkpoints" / "last.ckpt", weights=False)["global_step"] == 4
    if strategy == "fsdp_cpu":  # a folder of shards continues under FSDP2 only: one sentence before a step
        other = [o for o in common if not o.startswith(("trainer=", "trainer.precision="))]
        refused = train(tmp_path / "refused", *other, "trainer=cpu", f"ckpt_path={last}", timeout=300)
        assert refused.returncode != 0 and "which continues under trainer=fsdp" in refused.stdout
        assert "init_from.path=" in refused.stdout and "Traceback" not in refused.stdout


# The options a GPU run switches on, on the character Transformer (its config ships a tensor-parallel
# plan), in bf16-mixed, three batches with accumulation over two. Each strategy runs the options it offers
# together, as a recipe would set them; the last cell adds tensor parallelism (2 processes, both in one
# tensor-parallel group: the split layers' gradients on the 2-D mesh, the rest on the data-parallel one).
TRANSFORMER = (
    "experiment=char_transformer",
    "trainer.precision=bf16-mixed",
    *EXPERIMENTS["char_transformer"],
    "model.net.n_layer=2",
    "model.net.n_embd=64",
    *TINY,
    "trainer.limit_train_batches=3",
    "trainer.gradient_clip_val=0.5",
    "trainer.accumulate_grad_batches=2",
)
# dynamo's graph capture and AOT autograd (what inductor compiles on GPUs), without inductor's C++ build
COMPILED = ("compile=true", "compile_backend=aot_eager")
OPTIONS = {
    "cpu": ("trainer=cpu", *COMPILED),
    "ddp_cpu": ("trainer=ddp_cpu",),  # compile under DDP: tests/test_beyond_mnist.py
    "fsdp_cpu": ("trainer=fsdp_cpu", "dist.fsdp.activation_checkpointing=true", *COMPILED),
    "fsdp_cpu, tensor parallel": (
        "trainer=fsdp_cpu",
        "dist.fsdp.activation_checkpointing=true",
        *COMPILED,
        "dist.tensor_parallel=2",
    ),
}


def test_the_option_cells_are_the_ones_the_page_lists():
    assert list(_rows("Options")) == list(OPTIONS)


@pytest.mark.parametrize("cell", OPTIONS)
def test_the_options_a_gpu_run_switches_on_fit_and_test_together(cell: str, tmp_path: Path):
    """Gradient clipping (over both meshes under tensor parallelism), accumulation (one gradient reduction
    per step under FSDP2), compile (each block under FSDP2), activation checkpointing (FSDP2)."""
    strategy = OPTIONS[cell][0].split("=")[1]
    result = train(tmp_path, *TRANSFORMER, *OPTIONS[cell], timeout=420)
    _ran(tmp_path, result, strategy, data_parallel=1 if "tensor parallel" in cell else 2)
    if strategy == "fsdp_cpu":
        assert "each block compiled (aot_eager)" in result.stdout
    if "tensor parallel" in cell:  # the plan's 6 layers in each of the 2 blocks
        assert "tensor parallel: 12 layer(s) split over 2 process(es) each" in result.stdout


# Refused by design in the preflight, before torch is imported: the page's row -> (overrides, sentence)
REFUSED = {
    "trainer.precision=16-mixed with trainer=fsdp or fsdp_cpu": (
        ("trainer=fsdp_cpu", "trainer.precision=16-mixed"),
        "trainer.precision=16-mixed under FSDP2",
    ),
    "trainer.precision=16-mixed on CPU (trainer=cpu, ddp_cpu)": (
        ("trainer=ddp_cpu", "trainer.precision=16-mixed"),
        "trainer.precision=16-mixed needs a GPU",
    ),
    "dist.fsdp.cpu_offload=true with trainer=fsdp_cpu": (
        ("trainer=fsdp_cpu", "dist.fsdp.cpu_offload=true"),
        "dist.fsdp.cpu_offload=true with FSDP2 on CPU",
    ),
    "dist.tensor_parallel=N for a model whose config ships no dist.tensor_parallel_plan": (
        ("experiment=quickstart", "trainer=fsdp_cpu", "trainer.devices=4", "dist.tensor_parallel=2"),
        "the model's config ships no tensor-parallel plan",
    ),
    "dist.tensor_parallel=N that does not divide the processes": (
        ("experiment=char_transformer", "trainer=fsdp_cpu", "trainer.devices=4", "dist.tensor_parallel=3"),
        "does not divide the 4 processes",
    ),
    "dist.tensor_parallel=N with trainer=ddp_cpu or ddp": (
        ("experiment=char_transformer", "trainer=ddp_cpu", "dist.tensor_parallel=2"),
        "needs trainer=fsdp or trainer=fsdp_cpu",
    ),
    "trainer.precision=64-true with trainer=fsdp or fsdp_cpu": (
        ("trainer=fsdp_cpu", "trainer.precision=64-true"),
        "trainer.precision=64-true under FSDP2: Lightning's ModelParallelStrategy trains in",
    ),
    "dist.fsdp.param_dtype=float16 with trainer.precision=bf16-mixed under FSDP2": (
        ("trainer=fsdp_cpu", "trainer.precision=bf16-mixed", "dist.fsdp.param_dtype=float16"),
        "dist.fsdp.param_dtype=float16 with trainer.precision=bf16-mixed",
    ),
    "trainer.precision=16-true with an Adam optimizer": (
        ("experiment=quickstart", "trainer.precision=16-true"),
        "trainer.precision=16-true with model.optimizer=torch.optim.Adam: float16 optimizer states",
    ),
    "trainer.sync_batchnorm=true on CPU (trainer=ddp_cpu, fsdp_cpu)": (
        ("trainer=ddp_cpu", "trainer.sync_batchnorm=true"),
        "trainer.sync_batchnorm=true on CPU",
    ),
    "dist.backend=nccl on CPU": (("trainer=ddp_cpu", "dist.backend=nccl"), "dist.backend=nccl on CPU"),
    "dist.backend=mpi where torch has no MPI": (
        ("trainer=ddp_cpu", "dist.backend=mpi"),
        "dist.backend=mpi, but this torch was built without MPI",
    ),
    "trainer.accelerator=mps off macOS": (
        ("trainer.accelerator=mps",),
        "trainer.accelerator=mps: Apple's GPUs",
    ),
    "dist.fsdp.replicate=N with tensor parallelism, or not dividing the processes": (
        ("experiment=char_transformer", "trainer=fsdp_cpu", "trainer.devices=4", "dist.fsdp.replicate=3"),
        "dist.fsdp.replicate=3 needs a number of processes it divides (4 here)",
    ),
}


def test_every_refusal_the_page_lists_is_tested():
    """The page's rows refused in the preflight are the cases below; the others name where they are."""
    rows = _rows("Refused by design, in one sentence before the first step")
    assert set(REFUSED) <= set(rows), sorted(set(REFUSED) - set(rows))
    assert all("preflight" in rows[r][-1] for r in REFUSED)
    assert all(r in REFUSED or "preflight" not in cells[-1] for r, cells in rows.items())


@pytest.mark.parametrize("refused", REFUSED)
def test_a_combination_that_cannot_work_is_one_sentence_before_torch(refused: str, tmp_path: Path):
    """As the preflight of src/train.py sees it: the composed config, checked before anything is built."""
    overrides, sentence = REFUSED[refused]
    with pytest.raises(UserError, match=re.escape(sentence)):
        check_config(compose_train(tmp_path, tmp_path, *overrides))


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
