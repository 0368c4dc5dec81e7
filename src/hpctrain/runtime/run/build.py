"""Turn the composed config into what Lightning runs: datamodule, model, callbacks, loggers, trainer.

`run_objects` is the one build path of src/train.py and src/eval.py. Besides what the config names,
the trainer always gets:
- the cluster environment chosen by `hpctrain.runtime.distributed.launch` from the launcher
  (SLURM without Lightning's auto-requeue);
- `HydraDDPStrategy` for `strategy: ddp` (or `auto` with more than one process), with the
  collective timeout from `dist.timeout_min`;
- `AtomicCheckpointIO`, so a save killed half-way never replaces a complete checkpoint;
- `ResumeState` (exact resume, the config for eval), `MonitoredMetric` (`monitor.*`),
  `BatchLimits` (a `limit_*_batches` fraction of a tiny split is one batch),
  `NonFiniteLoss` (`nan.*`), `TrainableOnly` (`checkpoints.trainable_only`), `AttemptProgress` (run.yaml;
  a save too slow for `requeue.signal_lead_s`)
  and, when `requeue.enabled`, `RequeueOnSignal`.
All of it of the Lightning namespace the run's classes are written with (`run_namespace`: pytorch_lightning
or lightning.pytorch, `hpctrain.runtime.namespaces`), chosen before anything is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class
from lightning_fabric.utilities.seed import seed_everything  # namespace-free: seeds and environment variables
from omegaconf import DictConfig, OmegaConf
from torchmetrics import Metric

from hpctrain.callbacks.attempt_progress import AttemptProgress
from hpctrain.callbacks.batch_limits import BatchLimits
from hpctrain.callbacks.frozen_parts import FrozenParts
from hpctrain.callbacks.model_checkpoint import ModelCheckpoint
from hpctrain.callbacks.monitored_metric import MonitoredMetric, no_monitor_note
from hpctrain.callbacks.non_finite_loss import NonFiniteLoss
from hpctrain.callbacks.one_rank_calls import OneRankCalls
from hpctrain.callbacks.rank_watchdog import RankWatchdog
from hpctrain.callbacks.requeue_on_signal import RequeueOnSignal
from hpctrain.callbacks.resume_state import ResumeState
from hpctrain.callbacks.shared_run_dir_check import SharedRunDirCheck
from hpctrain.callbacks.trainable_only import TrainableOnly
from hpctrain.loggers import job_metadata, tag_runs
from hpctrain.runtime import namespaces
from hpctrain.runtime.config import redact, targets
from hpctrain.runtime.config.arguments import check_arguments
from hpctrain.runtime.config.settings import Cluster, Dist, Requeue, Settings, TrainerKeys
from hpctrain.runtime.distributed import launch, signals
from hpctrain.runtime.distributed.fsdp import HydraModelParallelStrategy
from hpctrain.runtime.distributed.launch import HydraDDPStrategy
from hpctrain.runtime.distributed.materialize import has_empty_parameters, materialize
from hpctrain.runtime.environment import allocated, launched
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import Namespace
from hpctrain.runtime.report import console
from hpctrain.runtime.storage.checkpoints import REQUEUE_CHECKPOINT, checkpoint_dir
from hpctrain.runtime.storage.checkpoints.async_writing import AsyncAtomicCheckpointIO
from hpctrain.runtime.storage.checkpoints.folder_saves import FolderSaves
from hpctrain.runtime.storage.checkpoints.sharded import consolidate
from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO

if TYPE_CHECKING:
    from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer
    from pytorch_lightning.loggers import Logger

log = logging.getLogger(__package__)
STORED_GROUPS = ("model", "data", "monitor")  # the config a checkpoint keeps (ResumeState)


@dataclass
class Run:
    """What a run trains and tests, and the two template callbacks its entry point asks about."""

    datamodule: LightningDataModule
    model: LightningModule
    trainer: Trainer
    monitor: MonitoredMetric | None  # the best value of monitor.metric, returned to sweepers
    requeue: RequeueOnSignal | None  # checkpoints and stops where every rank agrees, on a signal
    namespace: Namespace  # the Lightning namespace all of it is of (`run_namespace`)

    def fit(self, checkpoint: str | Path | None) -> None:
        if checkpoint is not None and Path(checkpoint).is_dir() and not _sharded_strategy(self.trainer):
            raise UserError(
                f"ckpt_path={checkpoint} is a sharded checkpoint (FSDP2), which continues under trainer=fsdp or "
                "trainer=fsdp_cpu only; to train it with another strategy, start a new run from its weights: "
                f"init_from.path={checkpoint}."
            )
        self.check_namespace()
        self.trainer.fit(self.model, self.datamodule, ckpt_path=checkpoint, weights_only=True)
        if self.requeue is not None:
            self.requeue.after_fit(self.trainer)  # a signal during the last validation

    def test(self, checkpoint: str | Path | None) -> None:
        self._evaluate(self.trainer.test, checkpoint)

    def evaluate(self, checkpoint: str | Path, split: str | None) -> None:
        """src/eval.py: `checkpoint` on `split` (None: the test split where the model and the data have one,
        else the validation split, said in one line)."""
        lacking = {
            "test": missing_test(self.model, self.datamodule),
            "val": missing_hook(self.model, self.datamodule, "validation_step", "val_dataloader"),
        }
        if split is None:
            split = "test" if lacking["test"] is None else "val"
            if split == "val" and launched.is_rank_zero():
                log.info("eval: %s, so the checkpoint is evaluated on the validation split", lacking["test"])
        if lacking[split] is not None:
            other = "val" if split == "test" else "test"
            raise UserError(f"eval.split={split}, but {lacking[split]}; pass eval.split={other}.")
        self._evaluate(self.trainer.test if split == "test" else self.trainer.validate, checkpoint)

    def _evaluate(self, loop: Any, checkpoint: str | Path | None) -> None:
        self.check_namespace()
        if checkpoint is not None and Path(checkpoint).is_dir() and not _sharded_strategy(self.trainer):
            with tempfile.TemporaryDirectory() as tmp:  # a sharded checkpoint evaluated on one process, whole
                single = consolidate(checkpoint, Path(tmp) / "model.ckpt", safetensors=False)[0]
                loop(self.model, self.datamodule, ckpt_path=single, weights_only=True)
            return
        loop(self.model, self.datamodule, ckpt_path=checkpoint, weights_only=True)

    def best_checkpoint(self) -> str | None:
        return best_checkpoint(self.trainer)

    def check_namespace(self) -> None:
        """Every callback added since the build (a user's, the template's) is of the run's namespace: one
        of the other would be ignored by Lightning's checks, or refused with an error that does not say why."""
        for callback in self.trainer.callbacks:
            namespaces.check_built(f"callback {type(callback).__name__}", callback, self.namespace)

    def can_test(self) -> bool:
        return can_test(self.model, self.datamodule)

    def freeze(self, patterns: list[str], until: int | None) -> str:
        """Freeze the parameters `patterns` name (`init_from.freeze`; a callback unfreezes them at epoch
        `until`); the line that says what was frozen."""
        frozen = self.namespace.part(FrozenParts)(self.model, patterns, until)  # of the run's namespace
        self.trainer.callbacks.append(frozen)
        return (
            f"init_from.freeze: {len(frozen.frozen)} parameters frozen, {len(frozen.norms)} BatchNorm layers fixed"
            + (f", until epoch {until}" if until is not None else "")
        )

    @property
    def best_value(self) -> float | None:
        return self.monitor.best if self.monitor is not None else None


def _sharded_strategy(trainer: Trainer) -> bool:
    model_parallel = namespaces.namespace_of(trainer).get(
        "pytorch_lightning.strategies.ModelParallelStrategy"
    )
    return isinstance(trainer.strategy, model_parallel)


def configure_process(cfg: DictConfig, settings: Settings) -> None:
    """The process-wide settings a run makes, in one visible place: seeds, CPU threads and loader
    workers, float32 matmul precision."""
    # Seeds torch, numpy, python and (through PL_SEED_WORKERS) every dataloader worker.
    seed_everything(settings.seed, workers=True, verbose=False)
    threads, _, why = cpu_plan(cfg, settings)  # the workers are the datamodule's (`datamodule`)
    # Set before the trainer exists: Lightning's DDP launcher sets its own (CPUs / processes) only when
    # OMP_NUM_THREADS is unset, and its child ranks inherit the variable.
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if launched.is_rank_zero():
        log.info("CPU: %s", why)
    precision = settings.extras.float32_matmul_precision
    if precision:
        torch.set_float32_matmul_precision(precision)


def cpu_plan(cfg: DictConfig, settings: Settings) -> tuple[int, int | None, str]:
    """Intra-op threads per process and `data.num_workers` (None: the config's number stays) for
    `num_threads: auto` and `data.num_workers: auto`, from the CPUs the process really has. Loader
    workers that decode files come first (the CPUs less one, at most 8); in-memory data takes none
    (a batch is one tensor index). Threads get what is left: threads beyond a process's CPUs spin
    against each other and slow every process on them many times over. An explicit value is taken as
    given."""
    keys = settings.trainer
    cpus, found = allocated.cpus_per_process(keys.devices, accelerator=keys.accelerator)
    asked_workers = (cfg.get("data") or {}).get("num_workers", 0)
    workers = None
    if asked_workers == "auto":
        workers = min(8, max(1, cpus - 1)) if _data_class_has(cfg.data, "decodes_files") else 0
    used_by_workers = workers if workers is not None else int(asked_workers or 0)
    asked_threads = settings.num_threads
    threads = max(1, cpus - used_by_workers) if asked_threads in ("auto", None) else int(asked_threads)
    why = (
        f"{cpus} per process ({found}): {threads} intra-op thread(s) (num_threads={asked_threads}), "
        f"{used_by_workers} loader worker(s) (data.num_workers={asked_workers})"
    )
    return threads, workers, why


def _data_class_has(node: DictConfig, flag: str) -> bool:
    """Whether the datamodule class the config names sets `flag` (decodes_files, can_stage)."""
    try:
        return bool(getattr(get_class(node._target_), flag, False))
    except Exception:  # an unimportable target is reported when the datamodule is built
        return False


def run_objects(
    cfg: DictConfig, settings: Settings, run_dir: str | Path, training: bool = True, sweep: bool = False
) -> Run:
    """Datamodule, model, the data checked (on every rank, before any process group), callbacks,
    loggers and trainer for `cfg` (hpctrain's own keys read from `settings`, typed, checked in the
    preflight); with `training=False` (eval) no training-only callbacks; `sweep`: a point of a sweep,
    which needs the monitored value."""
    with namespace_of_run(cfg) as namespace:  # before anything is built: mixed imports are one sentence
        data = datamodule(cfg, settings)
        module = tune_model(model(cfg), settings, settings.trainer.strategy)  # its mistakes before tokenizing
        check_data_available(data)
        built = trainer(cfg, settings, run_dir, training=training, sweep=sweep)
    monitor = next((c for c in built.callbacks if isinstance(c, MonitoredMetric)), None)
    requeue = next((c for c in built.callbacks if isinstance(c, RequeueOnSignal)), None)
    return Run(data, module, built, monitor, requeue, namespace)


# The config entries whose classes choose the run's namespace; in the groups, Lightning's own classes
# (`pytorch_lightning.Trainer`, a LearningRateMonitor) follow it instead
DECIDING = ("model", "data")
FOLLOWING_LIGHTNINGS_OWN = ("trainer", "callbacks", "logger")


@contextmanager
def namespace_of_run(cfg: DictConfig) -> Iterator[Namespace]:
    """Within the block, what is built is of the run's Lightning namespace: the one being built already
    (`run_objects` building its parts), else the one `cfg`'s classes choose (`model(cfg)` alone, for eval's
    check or `hpctrain.load`)."""
    namespace = namespaces.being_built()
    if namespace is not None:
        yield namespace
        return
    namespace = run_namespace(cfg)
    console.lightning_logs_once()
    with namespaces.building(namespace):
        yield namespace


def run_namespace(cfg: DictConfig) -> Namespace:
    """The Lightning namespace of the run (`hpctrain.runtime.namespaces`), from the classes the config
    names: the model's and the datamodule's, and those of the trainer, callbacks and loggers that are not
    Lightning's own. Each is imported, none is built. Classes written with both namespaces are one sentence."""
    named: dict[str, type] = {}
    entries = [(key, cfg.get(key)) for key in (*DECIDING, "trainer")]
    for group in ("callbacks", "logger"):
        entries += [(f"{group}.{name}", entry) for name, entry in (cfg.get(group) or {}).items()]
    for key, entry in entries:
        target = entry.get("_target_") if isinstance(entry, DictConfig) else None
        if not isinstance(target, str):
            continue
        if key.split(".")[0] in FOLLOWING_LIGHTNINGS_OWN and namespaces.owner(target) is not None:
            continue  # Lightning's own class: built from the run's namespace, whichever it is
        try:
            found = namespaces.located(target)
        except Exception:  # not importable: said in one sentence when it is built
            continue
        if isinstance(found, type):  # a factory's result is checked once it is built (`_of_the_run`)
            named[key] = found
    return namespaces.choose(named)


def _instantiate(node: DictConfig, **kwargs: Any) -> Any:
    # _convert_="all": user classes receive plain lists and dicts, not OmegaConf containers, which
    # would be pickled into checkpoints by save_hyperparameters() and then refused by weights_only loading.
    node = _in_namespace(node, namespaces.current())
    try:
        return targets.instantiate(node, _convert_="all", **kwargs)  # Hydra 1.4: its targets, whitelisted
    except InstantiationException as err:
        if isinstance(err.__cause__, UserError):
            raise err.__cause__ from None  # the class's own sentence, not Hydra's wrapping of it
        sentence = _import_failure(err)
        if sentence is None:
            raise
        raise UserError(sentence) from err


def built_from_file(node: Any, key: str) -> Any:
    """A model or data config read from a file (already admitted by `targets.check_stored`), built from
    its plain values (`targets.build_stored`: no interpolation on a file's strings), and checked as the
    project's own are, in the Lightning namespace of the run being built, else of the class it names."""
    target = node.get(targets.TARGET) if isinstance(node, dict) else None
    named = targets.locate(target) if isinstance(target, str) else None
    namespace = namespaces.being_built() or namespaces.choose({key: named} if isinstance(named, type) else {})
    try:
        with namespaces.building(namespace):
            built = _of_the_run(targets.build_stored(_not_staged(node)), key)
    except TypeError as err:  # arguments the class does not take: the file was written for other code
        raise UserError(
            f"{key}: the stored config does not fit the class it names ({err}); build this project's own with "
            f"{key}=<option>, or use a checkpoint of this version of the code."
        ) from err
    if isinstance(built, torch.nn.Module) and has_empty_parameters(built):
        materialize(built, "cpu")  # a pretrained base built empty (`hpctrain.empty_weights`): read it now
    return built


def _not_staged(node: Any) -> Any:
    """A file's config with every `stage_dir` (a node-local copy of data or of a base model) set to null:
    nothing is copied to, or removed from, a folder a received file names."""
    if isinstance(node, dict):
        return {k: None if k == "stage_dir" else _not_staged(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_not_staged(v) for v in node]
    return node


def _in_namespace(node: DictConfig, namespace: Namespace) -> Any:
    """`node` with Lightning's own classes named as `namespace` spells them (`pytorch_lightning.Trainer`
    is `lightning.pytorch.Trainer` in a run of the `lightning` package's classes); unchanged if none differ."""
    try:
        plain = OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation that fails: Hydra says so when it instantiates
        return node
    named = [t for _, t in targets.targets_in(plain) if isinstance(t, str)]
    if all(namespace.spell(t) == t for t in named):
        return node
    return _respelled(plain, namespace)


def _respelled(node: Any, namespace: Namespace) -> Any:
    if isinstance(node, dict):
        return {
            k: namespace.spell(v) if k == targets.TARGET and isinstance(v, str) else _respelled(v, namespace)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_respelled(v, namespace) for v in node]
    return node


def _import_failure(err: InstantiationException) -> str | None:
    """One sentence for a `_target_` that cannot be imported when Hydra builds it (a module that imports
    something missing as the class is built; a path is checked before, by `targets.locate`), instead of
    Hydra's three chained tracebacks."""
    cause = err.__cause__
    found = re.search(r"target '([^']+)'", str(err))
    if not isinstance(cause, ImportError) or found is None:
        return None
    missing = cause.__cause__ if isinstance(cause.__cause__, ImportError) else cause
    return str(targets.cannot_import(found.group(1), missing))


def datamodule(cfg: DictConfig, settings: Settings) -> LightningDataModule:
    with namespace_of_run(cfg):
        return _datamodule(cfg, settings)


def _datamodule(cfg: DictConfig, settings: Settings) -> LightningDataModule:
    node = cfg.data
    if node.get("num_workers") == "auto":
        node = OmegaConf.merge(node, {"num_workers": cpu_plan(cfg, settings)[1]})
    preset = settings.cluster or Cluster()
    if preset.offline and node.get("download"):
        # conf/cluster/<name>.yaml says the compute nodes have no internet: fail at once on missing data
        # (the datamodule's own sentence) instead of trying a download that can only time out
        node = OmegaConf.merge(node, {"download": False})
        if launched.is_rank_zero():
            log.info("cluster=%s: compute nodes are offline, so data.download=false", preset.name)
    scratch = preset.scratch_dir
    if scratch and "stage_dir" in node and node.stage_dir is None and _data_class_has(node, "can_stage"):
        # the preset's node-local scratch: data that can be staged (data=shards) is copied there per node
        node = OmegaConf.merge(node, {"stage_dir": scratch})
        if launched.is_rank_zero():
            log.info(
                "cluster=%s: data staged to its node-local scratch, data.stage_dir=%s", preset.name, scratch
            )
    check_arguments(node, "data")
    return _of_the_run(_instantiate(node), "data")


def model(cfg: DictConfig) -> LightningModule:
    """The LightningModule; a pretrained base it built empty (`hpctrain.empty_weights`) is read from its
    files now, except under FSDP2, where each rank reads its shards once the model is sharded."""
    # an optimizer's key it does not take: one sentence, not a TypeError later
    check_arguments(cfg.model, "model")
    with namespace_of_run(cfg):
        module = _of_the_run(_instantiate(cfg.model), "model")
    if has_empty_parameters(module) and (cfg.get("trainer") or {}).get("strategy") != "fsdp":
        materialize(module, "cpu")
    return module


def check_data_available(data: LightningDataModule) -> None:
    """Run the datamodule's `check_available()` if it has one (missing files are one sentence, at once)."""
    check = getattr(data, "check_available", None)
    if callable(check):
        check()


def _of_the_run(obj: Any, key: str) -> Any:
    """What a config entry built is of the namespace being built (a factory's result is known only now)."""
    namespaces.check_built(key, obj, namespaces.current())
    return obj


def _instantiate_group(group: DictConfig | None, key: str) -> list[Any]:
    """Instantiate every non-null entry of a group like `callbacks` or `logger`."""
    return list(_instantiate_named(group, key).values())


def _instantiate_named(group: DictConfig | None, key: str) -> dict[str, Any]:
    """`_instantiate_group`, each object under its name in the group."""
    if not group:
        return {}
    built = {
        str(name): _of_the_run(_instantiate(entry), f"{key}.{name}")
        for name, entry in group.items()
        if entry is not None and "_target_" in entry
    }
    # a factory may decline (mlflow_logger)
    return {name: obj for name, obj in built.items() if obj is not None}


def loggers(cfg: DictConfig) -> list[Logger]:
    return _instantiate_group(cfg.get("logger"), "logger")


def own_callbacks(
    settings: Settings, run_dir: str | Path, training: bool, sweep: bool = False
) -> tuple[MonitoredMetric | None, RequeueOnSignal | None]:
    """The two template callbacks an entry point asks about: the monitored metric (training only) and
    the requeue on a signal (when `requeue.enabled`)."""
    monitor, requeue = settings.monitor, settings.requeue
    monitored = (
        MonitoredMetric(monitor.metric, monitor.mode, sweep=sweep)
        if training and monitor is not None and monitor.metric
        else None
    )
    if training and monitored is None and launched.is_rank_zero():
        log.info(no_monitor_note(None))
    on_signal = (
        RequeueOnSignal(
            checkpoint_dir(run_dir) / REQUEUE_CHECKPOINT,
            check_every_n_steps=requeue.check_every_n_steps,
            timeout_min=settings.dist.timeout_min,
        )
        if requeue.enabled
        else None
    )
    return monitored, on_signal


def _attempt_progress(requeue: Requeue) -> AttemptProgress:
    """This attempt's progress in run.yaml; with requeue on, the check of a save against the signal's lead."""
    if not requeue.enabled:
        return AttemptProgress()
    return AttemptProgress(requeue.signal_lead_s, requeue.signal)


def callbacks(
    cfg: DictConfig,
    settings: Settings,
    run_dir: str | Path,
    has_logger: bool,
    training: bool = True,
    sweep: bool = False,
) -> list[Callback]:
    """The config's callbacks and the template's own (see the module docstring), in the order they run."""
    if training:
        check_checkpoint_entry(cfg.get("callbacks"), run_dir)
    named = _instantiate_named(cfg.get("callbacks"), "callbacks")
    callback_list = list(named.values())
    if settings.trainer.strategy == "fsdp":  # a callback that runs the model on one rank: one sentence
        callback_list.append(OneRankCalls({id(obj): name for name, obj in named.items()}))
    if not has_logger:
        lr_monitor = namespaces.current().get("pytorch_lightning.callbacks.LearningRateMonitor")
        callback_list = [c for c in callback_list if not isinstance(c, lr_monitor)]
    callback_list.append(TrainableOnly(settings.checkpoints.trainable_only))  # how eval reads them too
    callback_list.append(
        RankWatchdog(
            settings.dist.timeout_min,
            settings.dist.init_timeout_min,
            straggler_every_s=settings.diagnostics.straggler_every_s,
            straggler_factor=settings.diagnostics.straggler_factor,
        )
    )
    # a limit_*_batches fraction of a tiny split: one batch, not Lightning's refusal
    callback_list.append(BatchLimits())
    if training:
        # what eval, predict, export and hpctrain.load rebuild the run from
        recorded = redact.recorded(cfg)  # resolved, but no secret (hpctrain.runtime.config.redact)
        stored = {k: recorded[k] for k in STORED_GROUPS if k in recorded}
        callback_list += [
            ResumeState(stored),
            SharedRunDirCheck(str(run_dir)),
            _attempt_progress(settings.requeue),
        ]
        if settings.nan.action == "stop":
            callback_list.append(NonFiniteLoss(run_dir, settings.nan.check_every_n_steps))
    own = [c for c in own_callbacks(settings, run_dir, training, sweep) if c is not None]
    # the monitored metric first: at each validation it decides before the checkpoint and early
    # stopping look at the metric (Lightning runs callbacks in list order, ModelCheckpoint last)
    monitors = [c for c in own if isinstance(c, MonitoredMetric)]
    return monitors + callback_list + [c for c in own if c not in monitors]


def check_checkpoint_entry(group: DictConfig | None, run_dir: str | Path) -> None:
    """The template's `callbacks.model_checkpoint` writes the last.ckpt that a restarted job,
    `ckpt_path=last` and eval look for, in the run's checkpoint folder. Another `dirpath`, or
    `save_last: false`, would make resume silently find nothing, so either is refused, in one sentence.
    Checkpoint callbacks of your own, under other names, are Lightning's business and left alone."""
    entry = (group or {}).get("model_checkpoint")
    if not entry:
        return
    expected = checkpoint_dir(run_dir).resolve()
    dirpath = entry.get("dirpath")
    if dirpath is None or Path(str(dirpath)).resolve() != expected:
        raise UserError(
            f"callbacks.model_checkpoint.dirpath={dirpath} is not this run's checkpoint folder {expected}, where "
            "a restarted job and ckpt_path=last look for last.ckpt; keep dirpath: ${paths.output_dir}/checkpoints "
            "(the file names are yours: filename=...), or add a checkpoint callback of your own under another name."
        )
    if not entry.get("save_last"):
        raise UserError(
            f"callbacks.model_checkpoint.save_last={entry.get('save_last')}, but a restarted job and ckpt_path=last "
            "resume from last.ckpt; keep save_last: true (save_top_k chooses which other checkpoints stay)."
        )


def strategy(
    keys: TrainerKeys, dist: Dist, async_save: bool = False, compile_backend: str | None = None
) -> Any:
    """DDP and FSDP2 with the Hydra-aware launcher and the configured collective timeout; else as given.
    `compile_backend` (compile=true): FSDP2 compiles each block before sharding it (`tune_model` leaves
    those networks alone)."""
    strategy_name = keys.strategy
    # Created with the startup timeout; RankWatchdog sets dist.timeout_min once the first step is done.
    common = {
        "process_group_backend": dist.backend,
        "timeout": timedelta(minutes=float(dist.startup_timeout_min)),
    }
    if strategy_name == "fsdp":  # FSDP2 (distributed/fsdp.py: why FSDP1 is gone)
        return HydraModelParallelStrategy(
            FolderSaves(async_save),
            fsdp=fsdp_dtypes(dataclasses.asdict(dist.fsdp), str(keys.precision)),
            tensor_parallel_size=dist.tensor_parallel,
            tensor_parallel_plan=dist.tensor_parallel_plan,  # shipped with the model's config
            compile_backend=compile_backend,
            **common,
        )
    if strategy_name == "ddp" or (strategy_name == "auto" and keys.processes not in (None, 1)):
        # passed on to torch's DistributedDataParallel
        ddp_options = {k: True for k in ("find_unused_parameters", "static_graph") if getattr(dist, k)}
        return HydraDDPStrategy(**common, **ddp_options)
    return strategy_name


MIXED_DTYPES = {"bf16-mixed": "bfloat16"}  # 16-mixed: refused under FSDP2 (config/checks.py)


def fsdp_dtypes(fsdp: dict[str, Any], precision: str) -> dict[str, Any]:
    """FSDP2's mixed precision from the trainer's: under bf16-mixed with `dist.fsdp.param_dtype` unset,
    parameters are gathered and computed in bfloat16 and gradients reduced in float32.
    Autocast alone would compute in half precision yet gather and reduce float32: twice the traffic.
    An explicit `param_dtype` or `reduce_dtype` is kept; said once on rank 0."""
    half = MIXED_DTYPES.get(precision)
    if half is None or fsdp.get("param_dtype") is not None:
        return fsdp
    mixed_fsdp = {**fsdp, "param_dtype": half, "reduce_dtype": fsdp.get("reduce_dtype") or "float32"}
    if launched.is_rank_zero():
        log.info(
            "FSDP2: trainer.precision=%s, so parameters are gathered and computed in %s and gradients reduced in "
            "%s (dist.fsdp.param_dtype and reduce_dtype set either)",
            precision,
            half,
            mixed_fsdp["reduce_dtype"],
        )
    return mixed_fsdp


def tune_model(module: LightningModule, settings: Settings, strategy: str | None) -> LightningModule:
    """The template's switches on a built model, outside its config (so no class ever receives them):

    - `channels_last`: parameters and 4-D inputs of its networks in channels-last memory order (faster
      convolutions on GPUs under mixed precision);
    - `compile`: torch.compile each network in place (`nn.Module.compile`): the module and its
      state-dict keys stay the same, so checkpoints load with or without it. Under FSDP2, for a module
      that hpctrain shards, the strategy compiles each block instead (`strategy`).
    Networks are the module's direct children that hold parameters (metrics are left alone).
    """
    nets = [c for c in module.children() if not isinstance(c, Metric) and any(True for _ in c.parameters())]
    if settings.channels_last:
        module.to(memory_format=torch.channels_last)
        for net in nets:
            net.register_forward_pre_hook(_channels_last_inputs)
    sharded_here = strategy == "fsdp" and not namespaces.is_overridden("configure_model", module)
    if settings.compile and not sharded_here:
        for net in nets:
            net.compile(backend=settings.compile_backend)
    return module


def _channels_last_inputs(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4 else a
        for a in args
    )


def trainer(
    cfg: DictConfig,
    settings: Settings,
    run_dir: str | Path,
    training: bool = True,
    sweep: bool = False,
    **overrides: Any,
) -> Trainer:
    """The Trainer for `cfg.trainer`; keyword arguments replace config entries (e.g. logger=False)."""
    with namespace_of_run(cfg):
        return _trainer(cfg, settings, run_dir, training, sweep, **overrides)


def _trainer(
    cfg: DictConfig, settings: Settings, run_dir: str | Path, training: bool, sweep: bool, **overrides: Any
) -> Trainer:
    asynchronous = settings.checkpoints.async_save
    chosen_loggers = overrides.pop("logger", None)
    if chosen_loggers is None:
        chosen_loggers = loggers(cfg)
    kwargs: dict[str, Any] = {
        "logger": chosen_loggers or False,
        "callbacks": callbacks(cfg, settings, run_dir, bool(chosen_loggers), training, sweep),
        "strategy": strategy(
            settings.trainer,
            settings.dist,
            asynchronous,
            settings.compile_backend if settings.compile else None,
        ),
        "plugins": [
            launch.lightning_cluster_environment(namespaces.current()),
            (AsyncAtomicCheckpointIO if asynchronous else AtomicCheckpointIO)(redact.environment_values(cfg)),
        ],
    }
    if allocated.one_gpu_per_task() and settings.trainer.accelerator in allocated.GPU_ACCELERATORS:
        kwargs["devices"] = 1  # each task drives the one GPU SLURM bound to it (allocated.one_gpu_per_task)
    kwargs.update(overrides)
    built = _of_the_run(_instantiate(cfg.trainer, **kwargs), "trainer")
    signals.take_over_from_lightning(built)
    return built


def log_hyperparameters(trainer: Trainer, cfg: DictConfig) -> None:
    """Send the resolved config, and what ran it (`job`: `loggers.job_metadata`), to every logger (rank 0)."""
    if not trainer.loggers:
        return
    params = redact.recorded(cfg)  # a tracker keeps its params for good: no secret in them
    assert isinstance(params, dict)
    params["num_processes"] = trainer.world_size
    params["job"] = job_metadata(cfg.paths.output_dir)
    for logger in trainer.loggers:
        logger.log_hyperparams(params)
    tag_runs(trainer.loggers, params["job"])


def can_test(module: LightningModule, data: LightningDataModule) -> bool:
    """Whether `test=true` can test this model on this data: a module without a test_step (a GAN, say)
    or data without a test split is not an error, it is said once and the run completes."""
    missing = missing_test(module, data)
    if missing is not None and launched.is_rank_zero():
        log.info("no test: %s (pass test=false to skip it silently)", missing)
    return missing is None


def missing_test(module: LightningModule, data: LightningDataModule) -> str | None:
    """Why this model cannot be tested on this data (None: it can)."""
    missing = missing_hook(module, data, "test_step", "test_dataloader")
    if missing is None and not getattr(data, "has_test", True):  # e.g. an image folder without test/
        return "the datamodule has no test split"
    return missing


def missing_hook(module: LightningModule, data: LightningDataModule, step: str, loader: str) -> str | None:
    for owner, what, hook in ((module, "model", step), (data, "datamodule", loader)):
        if not namespaces.is_overridden(hook, owner):
            return f"the {what} has no {hook}"
    return None


def best_checkpoint(trainer: Trainer) -> str | None:
    """The best checkpoint of this fit, if a ModelCheckpoint saved one; with no monitored metric, or none
    computed yet (a run that ended before its first validation), the last one: the template's last.ckpt
    always holds the weights fit ended with."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, "best_model_path", "") if callback is not None else ""
    newest = isinstance(callback, ModelCheckpoint) or getattr(callback, "monitor", "") is None
    if not path and callback is not None and newest:
        path = getattr(callback, "last_model_path", "")
    return path if path and os.path.exists(path) else None  # a file, or a sharded checkpoint's folder
