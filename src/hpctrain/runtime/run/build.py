"""The composed config turned into what Lightning runs: `run_objects`, the one build path of every entry
point, reads as a table of contents; each object is built once, by its own function, and left as built:

    namespace    run_namespace(cfg)        the Lightning package the user's classes are written with
    datamodule   datamodule(cfg.data)
    model        model(cfg.model)          built (a reader's without memory, then checked against its
                                           checkpoint), with the template's switches (channels_last, compile)
    data checked check_data_available      on every rank, before any process group; after the model, whose
                                           mistakes come before a tokenizer runs
    trainer      trainer(cfg)              and what it runs with, each from its own function:
      loggers    loggers(cfg.logger)
      callbacks  callbacks(cfg.callbacks)  the user's and the template's, by concern and in one order
                                           (hpctrain.runtime.run.callbacks)
      strategy   strategy(settings)        DDP or FSDP2 with the Hydra-aware launcher and the collective
                                           timeout (`dist.*`); else Lightning's, as named
      plugins    plugins(cfg)              the cluster environment (SLURM without Lightning's requeue) and
                                           the checkpoint writer (a save killed half-way replaces nothing)

hpctrain's own keys come typed (`settings`); the user's groups travel as opaque nodes to instantiate. All of
it is of the Lightning namespace the run's classes are written with (`hpctrain.runtime.namespaces`).
"""

from __future__ import annotations

import contextlib
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
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_class
from lightning_fabric.utilities.seed import seed_everything  # namespace-free: seeds and environment variables
from omegaconf import DictConfig, OmegaConf
from torchmetrics import Metric

from hpctrain.callbacks.model_checkpoint import ModelCheckpoint
from hpctrain.callbacks.monitored_metric import MonitoredMetric
from hpctrain.callbacks.requeue_on_signal import RequeueOnSignal
from hpctrain.loggers import job_metadata, tag_runs
from hpctrain.runtime import namespaces
from hpctrain.runtime.config import proposals, redact, targets
from hpctrain.runtime.config.arguments import check_arguments
from hpctrain.runtime.config.settings import Cluster, Dist, Settings, TrainerKeys
from hpctrain.runtime.distributed import launch, signals
from hpctrain.runtime.distributed.fsdp import HydraModelParallelStrategy
from hpctrain.runtime.distributed.launch import HydraDDPStrategy
from hpctrain.runtime.distributed.materialize import empty_weights, has_empty_parameters, materialize
from hpctrain.runtime.environment import allocated, launched
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import Namespace
from hpctrain.runtime.report import console
from hpctrain.runtime.run import callbacks as run_callbacks
from hpctrain.runtime.storage.attempts import Attempt
from hpctrain.runtime.storage.checkpoints import checkpoint_dir, reading
from hpctrain.runtime.storage.checkpoints.async_writing import AsyncAtomicCheckpointIO
from hpctrain.runtime.storage.checkpoints.folder_saves import FolderSaves
from hpctrain.runtime.storage.checkpoints.sharded import consolidate
from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO

if TYPE_CHECKING:
    from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer
    from pytorch_lightning.loggers import Logger

log = logging.getLogger(__package__)


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

    def evaluate(self, checkpoint: str | Path | None, split: str | None) -> None:
        """src/eval.py: `checkpoint` on `split` (None: the test split where the model and the data have one,
        else the validation split, said in one line)."""
        lacking = {
            "test": missing_test(self.model, self.datamodule),
            "val": missing_hook(self.model, self.datamodule, "validation_step", "val_dataloader"),
        }
        if split is None and lacking["test"] and lacking["val"]:
            raise UserError(
                f"nothing to evaluate: {lacking['test']}, and {lacking['val']}; add a validation_step."
            )
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

    @property
    def best_value(self) -> float | None:
        return self.monitor.best if self.monitor is not None else None


def _sharded_strategy(trainer: Trainer) -> bool:
    model_parallel = namespaces.namespace_of(trainer).get(
        "pytorch_lightning.strategies.ModelParallelStrategy"
    )
    return isinstance(trainer.strategy, model_parallel)


def configure_process(settings: Settings, data: DictConfig) -> None:
    """The process-wide settings a run makes, in one visible place: seeds, CPU threads and loader
    workers (`data`'s), float32 matmul precision."""
    # Seeds torch, numpy, python and (through PL_SEED_WORKERS) every dataloader worker.
    seed_everything(settings.seed, workers=True, verbose=False)
    threads, _, why = cpu_plan(data, settings)  # the workers are the datamodule's (`datamodule`)
    # Set before the trainer exists: Lightning's DDP launcher sets its own (CPUs / processes) only when
    # OMP_NUM_THREADS is unset, and its child ranks inherit the variable.
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if launched.is_rank_zero():
        log.info("CPU: %s", why)
    precision = settings.extras.float32_matmul_precision
    if precision:
        torch.set_float32_matmul_precision(precision)


def cpu_plan(data: DictConfig, settings: Settings) -> tuple[int, int | None, str]:
    """Intra-op threads per process and `data.num_workers` (None: the config's number stays) for
    `num_threads: auto` and `data.num_workers: auto`, from the CPUs the process really has. Loader
    workers that decode files come first (the CPUs less one, at most 8); in-memory data takes none
    (a batch is one tensor index). Threads get what is left: threads beyond a process's CPUs spin
    against each other and slow every process on them many times over. An explicit value is taken as
    given."""
    keys = settings.trainer
    cpus, found = allocated.cpus_per_process(keys.devices, accelerator=keys.accelerator)
    asked_workers = (data or {}).get("num_workers", 0)
    workers = None
    if asked_workers == "auto":
        workers = min(8, max(1, cpus - 1)) if _data_class_has(data, "decodes_files") else 0
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
    cfg: DictConfig,
    settings: Settings,
    run_dir: str | Path,
    training: bool = True,
    sweep: bool = False,
    checkpoint: Checkpoint | None = None,
    attempt: Attempt | None = None,
) -> Run:
    """The run's objects (see the module docstring); with `training=False` (eval, predict) no training-only
    callbacks; `sweep`: a point of a sweep, which needs the monitored value; `checkpoint`: the one a reader
    evaluates; `attempt`: this process's attempt, recorded in run.yaml."""
    with namespaces.building(run_namespace(cfg)) as namespace:  # mixed imports: one sentence, nothing built
        data = datamodule(cfg.data, settings)
        module = model(cfg.model, settings, checkpoint)  # its mistakes before the data is tokenized
        check_data_available(data)  # missing files are one sentence, on every rank, before any process group
        built = trainer(cfg, settings, run_dir, training, sweep, module=module, attempt=attempt)
    monitor = next((c for c in built.callbacks if isinstance(c, MonitoredMetric)), None)
    requeue = next((c for c in built.callbacks if isinstance(c, RequeueOnSignal)), None)
    return Run(data, module, built, monitor, requeue, namespace)


# The config entries whose classes choose the run's namespace; in the groups, Lightning's own classes
# (`pytorch_lightning.Trainer`, a LearningRateMonitor) follow it instead
DECIDING = ("model", "data")
FOLLOWING_LIGHTNINGS_OWN = ("trainer", "callbacks", "logger")


@contextmanager
def namespace_of_run(cfg: Any) -> Iterator[Namespace]:
    """Within the block, what is built is of the run's Lightning namespace: the one being built already
    (`run_objects` building its parts), else the one the classes of `cfg` (a config, or some of its
    entries: {"model": node}) choose, for an object built alone (`model(node)` in a test or a script)."""
    namespace = namespaces.being_built()
    if namespace is not None:
        yield namespace
        return
    with namespaces.building(run_namespace(cfg)) as namespace:
        yield namespace


def run_namespace(cfg: Any) -> Namespace:
    """The Lightning namespace of the run (`hpctrain.runtime.namespaces`), from the classes the config
    names: the model's and the datamodule's, and those of the trainer, callbacks and loggers that are not
    Lightning's own. Each is imported, none is built. Classes written with both namespaces are one sentence."""
    console.lightning_logs_once()
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


def datamodule(node: DictConfig, settings: Settings) -> LightningDataModule:
    """The user's datamodule (`data`), with what the settings decide of it (`num_workers: auto`, an offline
    or staging cluster preset)."""
    if node.get("num_workers") == "auto":
        node = OmegaConf.merge(node, {"num_workers": cpu_plan(node, settings)[1]})
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
    with namespace_of_run({"data": node}):
        return _of_the_run(_instantiate(node), "data")


def model(
    node: DictConfig, settings: Settings | None = None, checkpoint: Checkpoint | None = None
) -> LightningModule:
    """The user's LightningModule (`model`), with the template's switches of `settings` (`tune_model`). A
    pretrained base it builds empty (`hpctrain.empty_weights`) is read from its files now, except under
    FSDP2, where each rank reads its shards once the model is sharded. For a `checkpoint` (eval, predict,
    export, hpctrain.load) every parameter is built without memory, compared with the file's tensors (one
    sentence if they do not fit), and only then given memory: the checkpoint's weights fill it next."""
    check_arguments(node, "model")  # an optimizer's key it does not take: one sentence, not a TypeError later
    with namespace_of_run({"model": node}), empty_weights() if checkpoint else contextlib.nullcontext():
        module = _of_the_run(_instantiate(node), "model")
    if checkpoint is not None:
        reading.check_matches_model(checkpoint.path, module, content=checkpoint.content)
    sharded = settings is not None and settings.trainer.strategy == "fsdp"
    if has_empty_parameters(module) and not sharded:
        materialize(module, "cpu", checkpoint_fills=checkpoint is not None)
    return tune_model(module, settings) if settings is not None else module


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint a reader builds its model for: its path and what `reading.read` found in it."""

    path: Path
    content: dict[str, Any]


def instantiated(node: DictConfig, key: str, **values: Any) -> Any:
    """`node` built in the namespace being built, `values` in place of its own of those names (a reader's
    datamodule: `num_workers=0`)."""
    plain = OmegaConf.to_container(node, resolve=True)  # its interpolations resolve where it stands
    plain.update({k: v for k, v in values.items() if k in plain})
    return _of_the_run(_instantiate(OmegaConf.create(plain)), key)


def check_data_available(data: LightningDataModule) -> None:
    """Run the datamodule's `check_available()` if it has one (missing files are one sentence, at once)."""
    check = getattr(data, "check_available", None)
    if callable(check):
        check()


def _of_the_run(obj: Any, key: str) -> Any:
    """What a config entry built is of the namespace being built (a factory's result is known only now)."""
    namespaces.check_built(key, obj, namespaces.current())
    return obj


def _instantiate_named(group: DictConfig | None, key: str) -> dict[str, Any]:
    """Every non-null entry of a group like `callbacks` or `logger`, built, under its name in the group."""
    if not group:
        return {}
    built = {
        str(name): _of_the_run(_instantiate(entry), f"{key}.{name}")
        for name, entry in group.items()
        if entry is not None and "_target_" in entry
    }
    # a factory may decline (mlflow_logger)
    return {name: obj for name, obj in built.items() if obj is not None}


def loggers(group: DictConfig | None) -> list[Logger]:
    """The user's loggers (`logger`), each a config entry."""
    return list(_instantiate_named(group, "logger").values())


def callbacks(
    cfg: DictConfig,
    settings: Settings,
    run_dir: str | Path,
    has_logger: bool,
    training: bool = True,
    sweep: bool = False,
    module: LightningModule | None = None,
    attempt: Attempt | None = None,
) -> list[Callback]:
    """The user's callbacks (`callbacks`) and the template's (hpctrain.runtime.run.callbacks), in one order."""
    group = cfg.get("callbacks")
    if training:
        check_checkpoint_entry(group, run_dir)
    users = _instantiate_named(group, "callbacks")
    if not has_logger:  # a learning-rate monitor without a logger is Lightning's refusal
        lr_monitor = namespaces.current().get("pytorch_lightning.callbacks.LearningRateMonitor")
        users = {name: c for name, c in users.items() if not isinstance(c, lr_monitor)}
    stored = stored_config(cfg) if training else None
    own = run_callbacks.template_callbacks(settings, Path(run_dir), training, sweep, stored, attempt, module)
    return run_callbacks.ordered(users, own, settings)


def stored_config(cfg: DictConfig) -> dict[str, Any]:
    """What every checkpoint keeps for eval, predict, export and hpctrain.load to propose: the options the
    run composed and its model, data and monitor values, resolved but with no secret (`redact`)."""
    stored = redact.recorded(cfg, proposals.GROUPS)
    composed = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    stored["choices"] = proposals.choices_of(composed)
    return stored


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
    keys: TrainerKeys,
    dist: Dist,
    async_save: bool = False,
    compile_backend: str | None = None,
    checkpoint_fills: bool = False,
) -> Any:
    """DDP and FSDP2 with the Hydra-aware launcher and the configured collective timeout; else as given.
    `compile_backend` (compile=true): FSDP2 compiles each block before sharding it (`tune_model` leaves
    those networks alone); `checkpoint_fills`: a reader's model, built without memory, gets its weights
    from the checkpoint."""
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
            checkpoint_fills=checkpoint_fills,
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


def tune_model(module: LightningModule, settings: Settings) -> LightningModule:
    """The template's switches on a built model, outside its config (so no class ever receives them):

    - `channels_last`: parameters and 4-D inputs of its networks in channels-last memory order (faster
      convolutions on GPUs under mixed precision); under FSDP2, which shards contiguous parameters only,
      the inputs alone (a convolution computes in its input's order);
    - `compile`: torch.compile each network in place (`nn.Module.compile`): the module and its
      state-dict keys stay the same, so checkpoints load with or without it. Under FSDP2, for a module
      that hpctrain shards, the strategy compiles each block instead (`strategy`).
    Networks are the module's direct children that hold parameters (metrics are left alone).
    """
    nets = [c for c in module.children() if not isinstance(c, Metric) and any(True for _ in c.parameters())]
    if settings.channels_last:
        if settings.trainer.strategy != "fsdp":
            module.to(memory_format=torch.channels_last)
        for net in nets:
            net.register_forward_pre_hook(_channels_last_inputs)
    sharded_here = settings.trainer.strategy == "fsdp" and not namespaces.is_overridden(
        "configure_model", module
    )
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
    module: LightningModule | None = None,
    attempt: Attempt | None = None,
    **overrides: Any,
) -> Trainer:
    """The Trainer of `cfg.trainer` and what it runs with (see the module docstring); keyword arguments
    replace its entries (e.g. logger=False)."""
    with namespace_of_run(cfg):
        chosen = overrides.pop("logger", None)
        logger_list = loggers(cfg.get("logger")) if chosen is None else chosen
        kwargs: dict[str, Any] = {
            "logger": logger_list or False,
            "callbacks": callbacks(
                cfg, settings, run_dir, bool(logger_list), training, sweep, module, attempt
            ),
            "strategy": strategy(
                settings.trainer,
                settings.dist,
                settings.checkpoints.async_save,
                settings.compile_backend if settings.compile else None,
                checkpoint_fills=not training,
            ),
            "plugins": plugins(cfg, settings),
        }
        if allocated.one_gpu_per_task() and settings.trainer.accelerator in allocated.GPU_ACCELERATORS:
            kwargs["devices"] = (
                1  # each task drives the one GPU SLURM bound to it (allocated.one_gpu_per_task)
            )
        built = _of_the_run(_instantiate(cfg.trainer, **{**kwargs, **overrides}), "trainer")
    signals.take_over_from_lightning(built)
    return built


def plugins(cfg: DictConfig, settings: Settings) -> list[Any]:
    """The cluster environment the launcher chose (SLURM without Lightning's auto-requeue), and the
    checkpoint writer: atomic (a save killed half-way replaces nothing), asynchronous with
    `checkpoints.async_save`, putting back as interpolations the values the config read from the
    environment wherever a class kept them."""
    writer = AsyncAtomicCheckpointIO if settings.checkpoints.async_save else AtomicCheckpointIO
    return [
        launch.lightning_cluster_environment(namespaces.current()),
        writer(redact.environment_values(cfg)),
    ]


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
