"""The differential cases: one user setup, built the same way by a plain `pl.Trainer` script
(tests/differential/bare.py) and by `python src/train.py` (the overrides below).

The user code is written with `import pytorch_lightning as pl` (user_code.py) or with `import lightning
as L` (user_code_lightning.py, the same code): `written_with` turns a case's configs into the latter's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

USER = "tests.differential.user_code"
CONF = Path(__file__).resolve().parent / "conf"
SEED = 1234
# what both sides pass to the Trainer (the template's trainer config has the same values for the rest)
TRAINER = {"max_epochs": 3, "log_every_n_steps": 5, "num_sanity_val_steps": 2, "min_epochs": 1}


@dataclass(frozen=True)
class Case:
    module: str  # a class of user_code.py, or a dotted path (Lightning's demo classes)
    data: str = "DigitsData"
    model: dict[str, Any] = field(default_factory=dict)  # the module's arguments, as Hydra config
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> Hydra config
    trainer: dict[str, Any] = field(default_factory=dict)
    processes: int = 1
    monitor: tuple[str, str] | None = ("val_loss", "min")  # None: the template's default, bare: none
    checkpoint_every_epoch: bool = False  # ModelCheckpoint(monitor=None): a file every epoch
    early_stopping_patience: int | None = None
    find_unused_parameters: bool = False
    bare_test_weights_only: bool | None = None  # bare Lightning's trainer.test(weights_only=...)
    # the model's and the data's config as a file of conf/model/, conf/data/ (a user's own YAML, read by both
    # sides) instead of `model=user` with the class named on the command line
    model_file: str | None = None
    data_file: str | None = None
    bare_tensorboard: bool = False  # bare Lightning logs to TensorBoard first (its default logger), then CSV


# The package the user code imports Lightning from -> the module holding that code
WRITTEN_WITH = {"pytorch_lightning": USER, "lightning": "tests.differential.user_code_lightning"}


def written_with(package: str, value: Any) -> Any:
    """`value` (a config, an override, a list of them) for the user code written with `package`: the
    classes of its module, and Lightning's own classes from the same package (as that user writes them)."""
    if isinstance(value, dict):
        return {key: written_with(package, v) for key, v in value.items()}
    if isinstance(value, list):
        return [written_with(package, v) for v in value]
    if package == "lightning" and isinstance(value, str):
        value = value.replace(f"{USER}.", f"{WRITTEN_WITH[package]}.")
        return value.replace("pytorch_lightning.", "lightning.pytorch.")
    return value


def target(name: str) -> str:
    return name if "." in name else f"{USER}.{name}"


HPARAMS_NET = {
    "net": {"_target_": f"{USER}.SimpleDenseNet", "hidden": 32},
    "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.01},
    "scheduler": {
        "_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau",
        "_partial_": True,
        "mode": "min",
        "factor": 0.5,
        "patience": 0,
    },
    "compile": False,
}
DEMOS = "pytorch_lightning.demos.boring_classes"


LAMBDA = {
    "_target_": "pytorch_lightning.callbacks.LambdaCallback",
    "on_train_epoch_end": {"_target_": "hydra.utils.get_method", "path": f"{USER}.epoch_ended"},
    "on_train_batch_end": {"_target_": "hydra.utils.get_method", "path": f"{USER}.batch_ended"},
}

CASES: dict[str, Case] = {
    "lambda_callback": Case("LitClassifier", callbacks={"lam": LAMBDA}),
    "configure_callbacks_and_appended": Case("WithOwnCallbacks"),
    "manual_optimization": Case("TwoOptimizerGAN"),
    "manual_optimization_ddp": Case("TwoOptimizerGAN", processes=2, find_unused_parameters=True),
    "reduce_lr_on_plateau": Case("PlateauClassifier", trainer={"max_epochs": 4}),
    "iterable_dataset_ddp": Case("LitClassifier", data="StreamData", processes=2),
    "gradient_accumulation": Case("LitClassifier", trainer={"accumulate_grad_batches": 3}),
    "sync_dist_ddp": Case("SyncDistClassifier", processes=2),
    "val_loss_only": Case("ValLossOnly"),
    "early_stopping": Case(
        "LitClassifier",
        monitor=("val_acc", "min"),  # accuracy rises, so under "min" it stops improving after the first epoch
        early_stopping_patience=1,
        trainer={"max_epochs": 8},
    ),
    # lightning-hydra-template's way: the network (an nn.Module) and partial optimizers in save_hyperparameters;
    # bare Lightning can test the best checkpoint only with weights_only=False
    "net_in_hparams": Case(
        "NetInHparamsClassifier", model=HPARAMS_NET, monitor=("val/acc", "max"), bare_test_weights_only=False
    ),
    # Lightning's demo classes log no metric at all: with the template's default monitor, last.ckpt only
    "logs_nothing": Case(f"{DEMOS}.BoringModel", data=f"{DEMOS}.BoringDataModule", monitor=None),
    "net_in_hparams_ddp": Case(
        "NetInHparamsClassifier",
        model=HPARAMS_NET,
        monitor=("val/acc", "max"),
        bare_test_weights_only=False,
        processes=2,
    ),
    # monitor.metric=null: no early stopping, last.ckpt only (bare: a ModelCheckpoint without a monitor)
    "monitor_null": Case("LitClassifier", monitor=(None, "min")),
    "two_val_sets": Case(
        "TwoValSetsClassifier", data="TwoValSetsData", monitor=("val_loss/dataloader_idx_1", "min")
    ),
    "checkpoint_state_resume": Case(
        "StatefulClassifier",
        checkpoint_every_epoch=True,
        callbacks={"epoch_counter": {"_target_": f"{USER}.EpochCounter"}},
    ),
    "onecycle_mid_epoch_resume": Case(
        "OneCycleClassifier", data="ResumableData", checkpoint_every_epoch=True
    ),
    # the best epoch (1) comes before the resume (after epoch 2), and every epoch after it is worse
    "best_before_resume": Case("PeaksEarly", monitor=("val_acc", "max"), trainer={"max_epochs": 4}),
}


# Public code as real projects write it (tests/differential/corpus.py): each trained once in one process and
# once under DDP (2 processes). Their model and data are files of conf/, as a user writes them.
CORPUS = "tests.differential.corpus"
CORPUS_CASES: dict[str, Case] = {
    "gan": Case(
        f"{CORPUS}.GAN",
        model_file="gan",
        data_file="digit_images",
        monitor=(None, "min"),
        bare_tensorboard=True,
    ),
    "finetuning": Case(
        f"{CORPUS}.TransferLearningModel",
        model_file="finetuning",
        data_file="image_digits",
        callbacks={"milestones": {"_target_": f"{CORPUS}.MilestonesFinetuning", "milestones": [1, 2]}},
        monitor=("val_acc", "max"),
    ),
    # its partial optimizer is kept by save_hyperparameters(): bare Lightning tests with weights_only=False
    "metric_collection": Case(
        f"{CORPUS}.MetricsClassifier",
        model_file="metrics_classifier",
        monitor=("val/acc", "max"),
        bare_test_weights_only=False,
    ),
    "logistic_regression": Case(f"{CORPUS}.LogisticRegression", model_file="logistic_regression"),
    "ema": Case(
        f"{CORPUS}.EMAClassifier",
        model_file="ema_classifier",
        data_file="lit_digits",
        callbacks={"ema": {"_target_": f"{CORPUS}.EMAWeightAveraging", "decay": 0.9}},
    ),
    # bare Lightning writes the tutorial's numpy learning rate into its checkpoints, then cannot read them back
    # with weights_only=True: its own test after fit is run with weights_only=False
    "transformer": Case(
        f"{CORPUS}.ReversePredictor",
        model_file="reverse_predictor",
        data_file="reverse",
        monitor=("val_acc", "max"),
        bare_test_weights_only=False,
    ),
}
CORPUS_WRITTEN_WITH_LIGHTNING = (
    "gan",
    "ema",
)  # `import lightning as L`; the others `import pytorch_lightning as pl`
for _name, _case in CORPUS_CASES.items():
    _case = CASES[f"corpus_{_name}"] = dataclasses.replace(
        _case, checkpoint_every_epoch=True
    )  # resumed from one
    CASES[f"corpus_{_name}_ddp"] = dataclasses.replace(
        _case,
        processes=2,
        find_unused_parameters=_name == "gan",  # the GAN's toggled optimizers, as under bare
    )


def callback_configs(
    case: Case, ckpt_dir: str, package: str = "pytorch_lightning"
) -> dict[str, dict[str, Any]]:
    """Every callback of the case as Hydra configs: the checkpoint (and early stopping), the case's
    own, and the harness's recorder. The template side gets the checkpoint from its own config."""
    metric, mode = case.monitor or (None, "min")
    chosen: dict[str, dict[str, Any]] = {
        "model_checkpoint": {
            "_target_": "pytorch_lightning.callbacks.ModelCheckpoint",
            "dirpath": ckpt_dir,
            "filename": "epoch_{epoch:03d}",
            "monitor": None if case.checkpoint_every_epoch else metric,
            "mode": mode,
            "save_last": True,
            "save_top_k": -1 if case.checkpoint_every_epoch else 1 if metric else 0,
            "auto_insert_metric_name": False,
        }
    }
    if case.early_stopping_patience is not None:
        chosen["early_stopping"] = {
            "_target_": "pytorch_lightning.callbacks.EarlyStopping",
            "monitor": metric,
            "mode": mode,
            "patience": case.early_stopping_patience,
        }
    chosen.update(case.callbacks)
    chosen["recorder"] = {"_target_": f"{USER}.Recorder"}
    return written_with(package, chosen)


def _overrides(prefix: str, node: Any) -> list[str]:
    if isinstance(node, dict):
        return [o for key, value in node.items() for o in _overrides(f"{prefix}.{key}", value)]
    value = "null" if node is None else str(node).lower() if isinstance(node, bool) else node
    return [f"{prefix}={value}"]


def template_overrides(
    case: Case,
    trainer: dict[str, Any] | None = None,
    extra_callbacks: dict | None = None,
    package: str = "pytorch_lightning",
) -> list[str]:
    """The `python src/train.py` overrides that build the case, of the user code written with `package`."""
    options = {**TRAINER, **case.trainer, **(trainer or {})}
    overrides = [
        *reader_overrides(case),
        "trainer=ddp_cpu" if case.processes > 1 else "trainer=cpu",
        f"seed={SEED}",
        *(
            _overrides("monitor", dict(zip(("metric", "mode"), case.monitor, strict=True)))
            if case.monitor
            else []
        ),
        "logger=csv",
        "diagnostics.straggler_every_s=0",  # no per-rank columns in metrics.csv, however slow the machine
        # the template's default callbacks, less what the bare side does not have
        *(f"callbacks.{name}=null" for name in ("lr_monitor", "model_summary", "progress", "throughput")),
        *_overrides("trainer", {k: v for k, v in options.items()}),
    ]
    if case.processes > 1:
        overrides.append(f"trainer.devices={case.processes}")
    if case.find_unused_parameters:
        overrides.append("dist.find_unused_parameters=true")
    if case.checkpoint_every_epoch:
        overrides += ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=-1"]
    if case.early_stopping_patience is None:
        overrides.append("callbacks.early_stopping=null")
    else:
        overrides.append(f"callbacks.early_stopping.patience={case.early_stopping_patience}")
    own = {**case.callbacks, "recorder": {"_target_": f"{USER}.Recorder"}, **(extra_callbacks or {})}
    for name, config in own.items():
        overrides += _overrides(f"+callbacks.{name}", config)
    return written_with(package, overrides)


def reader_overrides(case: Case, package: str = "pytorch_lightning") -> list[str]:
    """What chooses the case's code: its configs' folder, its model and data, and the classes and keys its
    training command line names. What eval, predict, export and hpctrain.load are given again for its
    checkpoints, as its user types them (a checkpoint proposes options and values, never code)."""
    model = (
        [f"model={case.model_file}"]
        if case.model_file
        else ["model=user", f"model._target_={target(case.module)}"]
    )
    data = (
        [f"data={case.data_file}"] if case.data_file else ["data=user", f"data._target_={target(case.data)}"]
    )
    chosen = [f"hydra.searchpath=[file://{CONF}]", *model, *_overrides("+model", case.model), *data]
    return written_with(package, chosen)


def config_of(case: Case, group: str) -> dict[str, Any]:
    """The Hydra config bare Lightning's script builds the case's model or data from: the case's file of
    conf/<group>/ as written (interpolations resolved when it is built), or its class with the case's args."""
    from omegaconf import OmegaConf

    name = case.model_file if group == "model" else case.data_file
    if name:
        written = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))
        return {**written, **(case.model if group == "model" else {})}
    if group == "model":
        return {"_target_": target(case.module), **case.model}
    return {"_target_": target(case.data)}


def user_overrides(
    module: str, data: str = "DigitsData", monitor: tuple[str, str] = ("val_loss", "min")
) -> list[str]:
    """`python src/train.py` overrides that train a user's module and datamodule from user_code.py, found
    through hydra.searchpath (run with PYTHONPATH holding the project root)."""
    return [*user_code(module, data), f"monitor.metric={monitor[0]}", f"monitor.mode={monitor[1]}"]


def user_code(module: str, data: str = "DigitsData") -> list[str]:
    """What chooses a user's module and datamodule of user_code.py: what eval, predict, export and
    hpctrain.load are given again for their checkpoints (a checkpoint proposes values, never code)."""
    return [
        f"hydra.searchpath=[file://{CONF}]",
        "model=user",
        f"model._target_={USER}.{module}",
        "data=user",
        f"data._target_={USER}.{data}",
    ]
