"""Contract tests of a model x data pair: what hpctrain needs from your LightningModule and your
datamodule, checked on your own pair (the docs: "Check your own model and data").

    pytest tests/contract --model=<conf/model option> --data=<conf/data option> [--override key=value ...]

A project's tests/contract/test_contract.py imports these tests (`from hpctrain.testing.contract import *`)
and `hpctrain.testing.plugin` gives them their options and fixtures; they come with hpctrain and are updated
with it. Without --model/--data they check quickstart's pair (model=mnist_cnn data=digits). Each test is one
promise; a failure says what in the pair's code breaks it and how to fix it:

1. one batch trains: the config composes and passes hpctrain's checks, and one batch of training
   gives a finite loss and a finite gradient to every trainable parameter (plus one batch of
   validation and test, as fast_dev_run does);
2. checkpoints load with weights_only=True, and the reloaded model gives the same outputs in eval mode;
3. DDP on CPU with two processes: a real `python src/train.py ... trainer=ddp_cpu` completes;
4. a run resumed mid-epoch ends with the same weights as an uninterrupted one, where the train
   loader can resume (a plain DataLoader cannot: hpctrain's warning is checked instead).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import torch
from lightning_fabric.utilities.seed import seed_everything  # namespace-free
from omegaconf import DictConfig
from torch import Tensor
from torchmetrics import Metric

from hpctrain.runtime.config.checks import check_config
from hpctrain.runtime.config.compose import CODE_ROOT, compose
from hpctrain.runtime.config.hydra_errors import describe_hydra_error
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart, namespace_of
from hpctrain.runtime.report import console
from hpctrain.runtime.run import build
from hpctrain.runtime.storage.checkpoints import reading
from hpctrain.runtime.storage.checkpoints.resume_state import resumes_mid_epoch

if TYPE_CHECKING:
    from pytorch_lightning import Callback, LightningModule, Trainer

T = TypeVar("T")

__all__ = [
    "pytestmark",
    "test_checkpoint_loads_weights_only_and_gives_the_same_outputs",
    "test_one_batch_trains_with_finite_gradients",
    "test_resumes_mid_epoch_exactly_or_says_it_cannot",
    "test_trains_with_ddp_on_cpu_in_two_processes",
]

# Each check trains a little (seconds): they run in the full suite and on demand, not in the quick tier.
pytestmark = pytest.mark.slow


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
        settings = Settings.of(cfg)
        console.apply_extras(cfg, settings.extras)  # as train.py: Lightning's notices the template replaces
        with template_errors_fail(self.pair):
            build.configure_process(settings, cfg.data)
            return build.run_objects(cfg, settings, cfg.paths.output_dir, training=training)

    def trainer(self, cfg: DictConfig, training: bool = True) -> Trainer:
        """The trainer alone (src/eval.py's kind with training=False)."""
        with template_errors_fail(self.pair):
            return build.trainer(cfg, Settings.of(cfg), cfg.paths.output_dir, training=training)

    def callback(self, cfg: DictConfig, cls: type[T], *args: Any) -> T:
        """One of these tests' callbacks (`cls`), of the Lightning namespace the pair is written with."""
        return build.run_namespace(cfg).part(cls)(*args)

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


def _pair(config: pytest.Config) -> Pair:
    return Pair(
        config.getoption("--model"), config.getoption("--data"), tuple(config.getoption("--override"))
    )


class SaveAtStep(LightningPart, lightning="pytorch_lightning.Callback"):
    """Saves a checkpoint at one step boundary inside fit (as a preemption would), then goes on."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def train(log_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`python src/train.py` in the project, its outputs under `log_dir`; stdout and stderr together."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    command = [
        sys.executable,
        "src/train.py",
        f"paths.log_dir={log_dir}",
        "extras.print_config=false",
        *overrides,
    ]
    return subprocess.run(
        command,
        cwd=CODE_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


PLAIN_LOADER_WARNING = "resumed mid-epoch with a train dataloader that cannot resume"


def fail(sentence: str) -> None:
    """Fail with the sentence alone: it says what in the pair's code is wrong, the test's source does not."""
    pytest.fail(sentence, pytrace=False)


def _named(names: list[str] | set[str], shown: int = 5) -> str:
    ordered = sorted(names)
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return ", ".join(ordered[:shown]) + more


def _class_name(module: LightningModule) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


# ------------------------------------------------------------------------------------ 1. one batch


class GradientProbe(LightningPart, lightning="pytorch_lightning.Callback"):
    """Records, over every backward pass of the run (one batch here; several with manual
    optimization), which trainable parameters got a gradient and which got a non-finite one."""

    def __init__(self) -> None:
        self.backward_passes = 0
        self.with_gradient: set[str] = set()
        self.non_finite: set[str] = set()
        self.losses: list[Tensor] = []

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.backward_passes += 1
        for name, parameter in pl_module.named_parameters():
            if parameter.requires_grad and parameter.grad is not None:
                self.with_gradient.add(name)
                if not torch.isfinite(parameter.grad).all():
                    self.non_finite.add(name)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self.losses.append(loss.detach())


def test_one_batch_trains_with_finite_gradients(contract: Contract, pair: Pair):
    cfg = contract.compose("debug=fdr")
    probe = contract.callback(cfg, GradientProbe)
    run = contract.fit(cfg, callbacks=[probe])
    contract.test(run)
    module = _class_name(run.model)

    if probe.backward_passes == 0:
        fail(
            f"{pair}: {module}.training_step ran on a batch but no backward pass followed, so nothing was "
            "trained; return the loss tensor (or a dict with a 'loss' key) from training_step, or, with "
            "automatic_optimization=False, call self.manual_backward(loss)."
        )
    bad_losses = [float(loss) for loss in probe.losses if loss.numel() == 1 and not torch.isfinite(loss)]
    if bad_losses:
        fail(
            f"{pair}: the loss of the first training batch is {bad_losses[0]}; look for a log of 0 or a "
            "division by 0, an exploding initialisation, or inputs that are not normalised."
        )
    # 16-bit mixed precision scales the loss and skips a step whose gradients overflowed: there an
    # infinite gradient at the first step is the scaler at work, not a bug.
    if probe.non_finite and not str(cfg.trainer.precision).startswith("16"):
        fail(
            f"{pair}: {len(probe.non_finite)} parameter(s) of {module} got a non-finite gradient from the "
            f"first training batch ({_named(probe.non_finite)}), although the loss is finite; look for a "
            "sqrt or log of 0, or a division by a value that can be 0, on their path to the loss."
        )
    trainable = {name for name, p in run.model.named_parameters() if p.requires_grad}
    unused = trainable - probe.with_gradient
    # DDP refuses parameters without a gradient unless told (dist.find_unused_parameters) or unless the
    # graph is the same every step (dist.static_graph); either setting is the user's statement that
    # the parameters are unused on purpose.
    declared = cfg.dist.find_unused_parameters or cfg.dist.static_graph
    if unused and not declared:
        fail(
            f"{pair}: {len(unused)} of {len(trainable)} trainable parameters of {module} got no gradient "
            f"from the first training batch ({_named(unused)}), which stops DDP at its second step; remove "
            "them or freeze them (requires_grad=False) if they are never used, or, if they are used only "
            "in some steps, pass --override dist.find_unused_parameters=true here and "
            "dist.find_unused_parameters=true to train.py."
        )


# ---------------------------------------------------------------------------- 2. checkpoint round trip


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


@contextmanager
def first_outputs(module: LightningModule) -> Iterator[dict[str, list[Tensor]]]:
    """The outputs of the module's networks (its direct children that hold parameters, metrics left
    out, as `hpctrain.runtime.run.build.tune_model` counts them) on the first batch they see."""
    outputs: dict[str, list[Tensor]] = {}
    handles = []
    for name, child in module.named_children():
        if isinstance(child, Metric) or not any(True for _ in child.parameters()):
            continue

        def record(_child, _inputs, output, name=name):
            outputs.setdefault(name, _tensors(output))

        handles.append(child.register_forward_hook(record))
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _refusal(check: Callable[..., Any], *args: Any) -> str | None:
    """The template's sentence if `check(*args)` refuses (a UserError), else None."""
    try:
        check(*args)
    except UserError as err:
        return str(err)
    return None


def _eval_outputs(
    contract: Contract, cfg, module: LightningModule, datamodule, stage: str, ckpt_path: Path | None = None
) -> tuple[dict[str, list[Tensor]], dict[str, float]]:
    """The networks' outputs on the first batch of `stage` and the metrics the module logs over it, with
    a trainer built as src/eval.py builds one (the random state reset first, for modules that sample)."""
    trainer = contract.trainer(cfg, training=False)
    loop = trainer.validate if stage == "validation" else trainer.test
    seed_everything(cfg.seed, workers=True, verbose=False)
    with first_outputs(module) as outputs:
        (metrics,) = loop(module, datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False)
    return outputs, metrics


# The trainers that compare outputs are built as src/eval.py's, without the training callbacks whose
# states the checkpoint holds (Lightning's notice about them does not apply to a comparison).
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_checkpoint_loads_weights_only_and_gives_the_same_outputs(contract: Contract, pair: Pair):
    cfg = contract.compose(
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.num_sanity_val_steps=0",
    )
    trained = contract.fit(cfg)
    saved = contract.tmp_path / "round_trip.ckpt"
    trained.trainer.save_checkpoint(saved)  # what every checkpoint of a run holds, written by the template
    unreadable = _refusal(reading.read, saved)
    if unreadable:
        fail(f"{pair}: {unreadable}")
    reloaded = build.model(cfg.model)
    other_model = _refusal(reading.check_matches_model, saved, reloaded)
    if other_model:
        fail(
            f"{pair}: the model built again from the same config does not fit the checkpoint its own "
            "training saved, so a resumed run and src/eval.py refuse it; create every layer in __init__, "
            "not in setup() or configure_model(), which a model just built has not run. The template's "
            f"check says: {other_model}"
        )

    module, data = trained.model, trained.datamodule
    is_overridden = namespace_of(module).is_overridden  # Lightning's, of the pair's namespace
    if is_overridden("validation_step", module) and is_overridden("val_dataloader", data):
        stage = "validation"
    elif build.can_test(module, data):
        stage = "test"
    else:
        pytest.skip(
            f"{pair}: the checkpoint loads with weights_only=True, but the model has neither a "
            "validation_step nor a test_step (or the data no loader for them), so there is no eval-mode "
            "output to compare."
        )
    before, metrics_before = _eval_outputs(contract, cfg, module, data, stage)
    after, metrics_after = _eval_outputs(contract, cfg, reloaded, data, stage, ckpt_path=saved)
    fix = (
        "some state that shapes its outputs is not in state_dict(): keep it in a buffer "
        "(self.register_buffer) or an nn.Parameter, or save it in on_save_checkpoint and restore it in "
        "on_load_checkpoint."
    )
    for name, tensors in before.items():
        same = len(tensors) == len(after.get(name, [])) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, after[name], strict=False)
        )
        if not same:
            fail(
                f"{pair}: reloaded from its checkpoint, {_class_name(module)}.{name} gives other outputs on "
                f"the same {stage} batch in eval mode; {fix}"
            )
    differing = sorted(
        key
        for key in metrics_before
        if not (
            metrics_before[key] == metrics_after.get(key)
            or (math.isnan(metrics_before[key]) and math.isnan(metrics_after.get(key, 0.0)))
        )
    )
    if differing:
        changes = ", ".join(f"{k}: {metrics_before[k]} then {metrics_after.get(k)}" for k in differing[:3])
        fail(
            f"{pair}: reloaded from its checkpoint, {_class_name(module)} logs other {stage} values "
            f"({changes}); {fix}"
        )


# --------------------------------------------------------------------------------------- 3. DDP on CPU


def test_trains_with_ddp_on_cpu_in_two_processes(tmp_path: Path, pair: Pair):
    # The pair's trainer choice, if any, gives way to ddp_cpu (a later choice of a group wins).
    command = [
        *pair.options,
        "trainer=ddp_cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=2",
        "test=false",
    ]
    result = train(tmp_path, *command)
    if result.returncode != 0:
        print(result.stdout)  # pytest shows it under "Captured stdout call": the tracebacks of every rank
        errors = dict.fromkeys(line for line in result.stdout.splitlines() if line.startswith("error: "))
        shown = "\n".join(errors) or result.stdout[-3000:]
        fail(f"python src/train.py {' '.join(command)} exited with status {result.returncode}:\n{shown}")


# ------------------------------------------------------------------------------- 4. mid-epoch resume


def test_resumes_mid_epoch_exactly_or_says_it_cannot(
    contract: Contract, pair: Pair, caplog: pytest.LogCaptureFixture
):
    accumulate = int(contract.compose().trainer.accumulate_grad_batches)
    steps_per_epoch, save_at = 4, 6  # the checkpoint falls half-way through the second epoch
    shape = (
        "trainer.max_epochs=2",
        "trainer.max_steps=-1",
        f"trainer.limit_train_batches={steps_per_epoch * accumulate}",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "trainer.check_val_every_n_epoch=1",
    )
    checkpoint = contract.tmp_path / "mid_epoch.ckpt"
    first = contract.compose(*shape, run="uninterrupted")
    uninterrupted = contract.fit(
        first, callbacks=[contract.callback(first, SaveAtStep, save_at, str(checkpoint))]
    )
    if not checkpoint.is_file():
        fail(
            f"{pair}: the uninterrupted run ended at step {uninterrupted.trainer.global_step}, before step "
            f"{save_at} where this test saves its checkpoint; an early-stopping callback or the model's own "
            "stop condition (trainer.should_stop) ended it."
        )
    resumable = resumes_mid_epoch(uninterrupted.trainer.train_dataloader)
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        resumed = contract.fit(contract.compose(*shape, run="resumed"), ckpt_path=checkpoint)
    assert resumed.trainer.global_step == uninterrupted.trainer.global_step

    loader = type(uninterrupted.trainer.train_dataloader).__name__
    if not resumable:
        # A plain DataLoader has no position to save: the resumed epoch starts its data again. The
        # template says so once; this test passes, and leaves the same note in pytest's summary.
        if PLAIN_LOADER_WARNING not in caplog.text:
            fail(
                f"{pair}: a run resumed mid-epoch with a {loader} (no state_dict) did not warn that the "
                f"epoch's data restarts ('{PLAIN_LOADER_WARNING}'); the template's ResumeState callback "
                "is missing from the trainer."
            )
        warnings.warn(
            f"{pair}: the train loader ({loader}) cannot resume mid-epoch, so a resumed run redraws that "
            "epoch's data from its start; for exact resume, return hpctrain.data.make_loader(...) "
            "from train_dataloader (the docs: Your data).",
            stacklevel=1,
        )
        return
    trained = dict(uninterrupted.model.state_dict())
    differing = [
        name
        for name, value in resumed.model.state_dict().items()
        if not (name in trained and torch.equal(value, trained[name]))
    ]
    if differing:
        fail(
            f"{pair}: resumed from a checkpoint at step {save_at} (mid-epoch), {len(differing)} tensor(s) "
            f"end differently from the uninterrupted run ({_named(differing)}) although the train loader "
            f"({loader}) resumes; some state that training depends on is not restored: keep it in a "
            "buffer or save it in on_save_checkpoint / on_load_checkpoint, and draw randomness from "
            "torch's generator."
        )
