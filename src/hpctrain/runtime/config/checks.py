"""Checks on the composed config, before anything heavy runs.

Hydra rejects unknown keys and options itself (made one sentence by `hpctrain.runtime.errors`); these checks
catch what composes but cannot work, and say so in one sentence instead of a stack trace from deep
inside Lightning ten seconds later:
- a value of the wrong type or out of range (the table in `hpctrain.runtime.config.schema`);
- a required value left out (`???`) or an interpolation that points nowhere;
- a precision this accelerator cannot run, a logger whose package is missing, a secret in the config
  (a webhook URL too: `check_command_line` refuses `notify.url=...` before Hydra can print or store it);
- k-fold settings that do not go together (`data.num_folds`, `data.fold`; `check_folds`);
- an output file that exists already (it is not overwritten).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from numbers import Integral
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from hpctrain.runtime.config.schema import GROUP_KEYS, validate
from hpctrain.runtime.config.settings import InitFrom, Notify, Settings
from hpctrain.runtime.environment import allocated
from hpctrain.runtime.errors import UserError

# packages an optional logger needs, recognised in its _target_ (TensorBoardLogger, mlflow_logger, ...)
LOGGER_PACKAGES = ("tensorboard", "mlflow", "wandb")
SECRET = re.compile(r"(api_?key|token|password|secret)", re.IGNORECASE)
SECRET_ENV = {"wandb": "WANDB_API_KEY", "mlflow": "MLFLOW_TRACKING_TOKEN"}

_ABSENT = object()
ADAMS = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")  # divide by the root of a moment plus eps
FLOAT16_TINIEST = 6e-8  # float16's smallest positive value, about 5.96e-8: anything less is 0


def _value(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=True)
    except MissingMandatoryValue as err:
        raise UserError(f"{key} is required; pass {key}=<value>.") from err
    except OmegaConfBaseException as err:
        message = str(err).splitlines()[0]
        raise UserError(f"{key} cannot be resolved ({message}); check the value you passed for it.") from err


def _resolve_everything(cfg: DictConfig) -> None:
    """Resolve every value now, so a dangling ${...} or a `???` fails here, naming its key."""
    try:
        for key in sorted(OmegaConf.missing_keys(cfg)):
            raise UserError(f"{key} is required; pass {key}=<value>.")
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as err:
        key = getattr(err, "full_key", "") or "a value"
        detail = " ".join(str(err).split("\n")[0].split())
        raise UserError(
            f"{key} cannot be resolved ({detail}); add the missing key to the config it refers to, or set "
            f"{key}=<value> directly."
        ) from err


def _check_tensor_parallel(settings: Settings, fsdp: bool) -> None:
    """dist.tensor_parallel needs FSDP2 and a number of processes it divides (when the config fixes it);
    dist.fsdp.replicate the same, without tensor parallelism."""
    tensor, keys, replicate = settings.dist.tensor_parallel, settings.trainer, settings.dist.fsdp.replicate
    if fsdp and replicate > 1 and (tensor > 1 or (keys.processes or replicate) % replicate):
        raise UserError(replicate_refused(replicate, keys.processes, tensor))
    if tensor in (None, 1):
        return
    if not fsdp:
        strategy = keys.strategy
        raise UserError(
            f"dist.tensor_parallel={tensor} needs trainer=fsdp or trainer=fsdp_cpu (FSDP2's 2-D mesh); with "
            f"trainer.strategy={strategy} pass dist.tensor_parallel=1."
        )
    processes = keys.processes
    if processes is None:
        return  # devices=auto: checked once the processes exist
    if processes % int(tensor):
        raise UserError(
            f"dist.tensor_parallel={tensor} does not divide the {processes} processes "
            "(trainer.num_nodes x trainer.devices); pass a divisor of it."
        )
    if not settings.dist.tensor_parallel_plan:
        raise UserError(
            f"dist.tensor_parallel={tensor}: the model's config ships no tensor-parallel plan "
            "(dist.tensor_parallel_plan), which hpctrain needs to split its layers; train with "
            "dist.tensor_parallel=1 (FSDP2 shards the model across all processes), or shard it yourself in "
            "the LightningModule's configure_model."
        )


def replicate_refused(replicate: int, processes: int | None, tensor: int) -> str:
    """The sentence for dist.fsdp.replicate and the processes or tensor parallelism it does not fit."""
    return (
        f"dist.fsdp.replicate={replicate} needs a number of processes it divides ({processes or 'auto'} here) and "
        f"dist.tensor_parallel=1 ({tensor} here); pass dist.fsdp.replicate=${{trainer.num_nodes}} (each node's "
        "processes shard, the nodes replicate) or 1."
    )


def _check_precision(settings: Settings) -> None:
    keys = settings.trainer
    precision, accelerator = str(keys.precision), keys.accelerator
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and allocated.visible_gpus() == 0)
    fsdp = keys.strategy == "fsdp"
    if fsdp and accelerator == "mps":
        raise UserError(
            "trainer.strategy=fsdp with trainer.accelerator=mps: FSDP2 runs on CUDA GPUs and CPUs; train on GPUs "
            "(trainer=fsdp) or on CPU (trainer=fsdp_cpu)."
        )
    if accelerator == "mps" and sys.platform != "darwin":
        raise UserError(
            "trainer.accelerator=mps: Apple's GPUs (MPS) exist on macOS only; pass trainer.accelerator=cpu, or "
            "gpu on a machine with NVIDIA GPUs."
        )
    if fsdp and on_cpu and settings.dist.fsdp.cpu_offload is True:
        raise UserError(
            "dist.fsdp.cpu_offload=true with FSDP2 on CPU: it moves parameters and optimizer states from GPU "
            "memory to the host, and on CPU they are there already; drop it (or train on GPUs, trainer=fsdp)."
        )
    several = keys.strategy in ("ddp", "fsdp") or keys.processes != 1
    if keys.sync_batchnorm and on_cpu and several:
        raise UserError(
            "trainer.sync_batchnorm=true on CPU: torch's SyncBatchNorm runs on GPUs only and would fail at the "
            "first training step; pass trainer.sync_batchnorm=false (or train on GPUs)."
        )
    if settings.dist.backend == "nccl" and on_cpu and several:
        raise UserError(
            "dist.backend=nccl on CPU: NCCL connects GPUs only; pass dist.backend=gloo, or null (the strategy's own)."
        )
    _check_mpi(settings.dist.backend)
    _check_tensor_parallel(settings, fsdp)
    if not fsdp and settings.dist.fsdp.activation_checkpointing:
        raise UserError(
            f"dist.fsdp.activation_checkpointing=true recomputes FSDP2's blocks, but trainer.strategy={keys.strategy}"
            "; without FSDP2 a model recomputes its own (model.gradient_checkpointing=true in model=causal_lm_lora)"
            ", or pass trainer=fsdp."
        )
    if fsdp and precision in ("16", "16-mixed"):
        raise UserError(
            f"trainer.precision={precision} under FSDP2 (trainer.strategy=fsdp): Lightning's ModelParallelStrategy "
            "has no float16 loss scaling and refuses it; pass trainer.precision=bf16-mixed on GPUs with bfloat16 "
            "(Ampere or newer) or trainer.precision=32-true on older ones (a model that fits one GPU: trainer=ddp "
            "trainer.precision=16-mixed)."
        )
    if fsdp and precision in ("64", "64-true"):
        raise UserError(
            f"trainer.precision={precision} under FSDP2: Lightning's ModelParallelStrategy trains in 32-true, "
            "bf16-mixed, bf16-true or 16-true only; pass one of them (float64: trainer=ddp or a single process)."
        )
    if fsdp and precision.startswith("bf16") and settings.dist.fsdp.param_dtype == "float16":
        raise UserError(
            f"dist.fsdp.param_dtype=float16 with trainer.precision={precision}: parameters gathered in float16 meet "
            "bfloat16 activations in kernels that refuse the mix; pass dist.fsdp.param_dtype=bfloat16, or null "
            f"({precision} gathers in bfloat16)."
        )
    if on_cpu and precision in ("16", "16-mixed"):
        raise UserError(
            f"trainer.precision={precision} needs a GPU: on CPU, Lightning would silently train in bf16-mixed "
            "instead; pass trainer.precision=bf16-mixed on CPU (or train on GPUs)."
        )


def _check_mpi(backend: str | None) -> None:
    """Only a torch built from source with MPI has it; the one check that imports torch, and only for mpi."""
    if backend == "mpi":
        import torch.distributed as dist

        if not dist.is_mpi_available():
            raise UserError(
                "dist.backend=mpi, but this torch was built without MPI (PyPI's wheels are); pass dist.backend=gloo "
                "or nccl, or null (the strategy's own)."
            )


def _check_half_adam(cfg: DictConfig, precision: str) -> None:
    """Adam's epsilon (1e-8 by default) is 0 in float16: with float16 weights and states, a NaN loss at once."""
    target = str(OmegaConf.select(cfg, "model.optimizer._target_", default=""))
    eps = OmegaConf.select(cfg, "model.optimizer.eps", default=1e-8)
    if precision == "16-true" and target.rsplit(".", 1)[-1] in ADAMS and float(eps) < FLOAT16_TINIEST:
        raise UserError(
            f"trainer.precision=16-true with model.optimizer={target}: float16 optimizer states, where its eps={eps:g} "
            "is 0, make the loss NaN at the first step; pass trainer.precision=16-mixed (GPUs), bf16-true or "
            "bf16-mixed, or +model.optimizer.eps=1e-4."
        )


def _check_loggers(cfg: DictConfig) -> None:
    for name, entry in (cfg.get("logger") or {}).items():
        # A key in the config first: it is refused whether or not the logger's package is installed.
        for key, value in (entry or {}).items():
            if SECRET.search(str(key)) and value not in (None, ""):
                variable = SECRET_ENV.get(name, "the logger's environment variable")
                raise UserError(
                    f"logger.{name}.{key} is set in the config, which is saved with every run (config.yaml, "
                    f"checkpoints); remove it and set {variable} in the environment instead."
                )
        target = str((entry or {}).get("_target_", "")).lower()
        for package in LOGGER_PACKAGES:
            if package in target and importlib.util.find_spec(package) is None:
                raise UserError(
                    f"logger={name} needs the {package} package, which is not installed; "
                    f"pip install -e '.[{package}]' (or pass logger=csv)."
                )


def notify_url_refused(key: str = "notify.url") -> UserError:
    """The sentence for a webhook URL put into the config; the URL is not repeated (it is a secret)."""
    return UserError(
        f"{key} holds the webhook URL, a secret that the config would save with the run (config.yaml, "
        "run.yaml, .hydra/, checkpoints, tracker params); remove it and set it in the environment instead: "
        "export HPCTRAIN_NOTIFY_URL=<the webhook URL> (or the variable notify.url_env names)."
    )


URL_ENV = Notify.url_env  # the default variable of the webhook URL


def _names_a_notify_url(key: str, value: str, url_env: str = URL_ENV) -> bool:
    """Whether an override (or a config entry) puts a webhook URL into the config: `notify.url=`, a
    `notify={url: ...}` dict, a URL given as notify.url_env (which names a variable), the variable
    itself set as a config key (`hydra.job.env_set.HPCTRAIN_NOTIFY_URL=...`, which Hydra records in
    .hydra/hydra.yaml), or the very URL the environment holds, under any key."""
    webhook = os.environ.get(url_env) or os.environ.get(URL_ENV)
    return (
        key == "notify.url"
        or (key == "notify" and re.search(r"\burl\s*:", value) is not None)
        or (key == "notify.url_env" and "://" in value)
        or key.rsplit(".", 1)[-1] in {url_env, URL_ENV}
        or (bool(webhook) and webhook in value)
    )


def check_command_line(argv: list[str]) -> None:
    """Before Hydra sees the command line: a webhook URL in it is refused, since Hydra would print it
    (`--cfg job`), store it (`.hydra/overrides.yaml`, a sweep's job list) and the answers keep it."""
    named = next((a.partition("=")[2] for a in argv if a.lstrip("+").startswith("notify.url_env=")), URL_ENV)
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if _names_a_notify_url(key.strip(), value, named.strip() or URL_ENV):
            raise notify_url_refused(key.strip())


def _check_notify(cfg: DictConfig) -> None:
    """A webhook URL written in a config file (an experiment, conf/local/): refused before it is echoed."""
    notify = cfg.get("notify")
    if not OmegaConf.is_dict(notify):
        return
    if "url" in notify or _names_a_notify_url("notify.url_env", str(_value(cfg, "notify.url_env"))):
        raise notify_url_refused()


def check_hydra_env(hydra_cfg: DictConfig, url_env: str | None) -> None:
    """The webhook URL set for the job through Hydra (`hydra.job.env_set`, e.g. from conf/local/) would be
    written into .hydra/hydra.yaml: refused as on the command line."""
    env_set = OmegaConf.select(hydra_cfg, "job.env_set") or {}
    for name in env_set:
        if _names_a_notify_url(f"hydra.job.env_set.{name}", "", url_env or URL_ENV):
            raise notify_url_refused(f"hydra.job.env_set.{name}")


def check_config(cfg: DictConfig, where: Any = None) -> Settings:
    """Raise UserError for the first problem found (see the module docstring); hpctrain's own settings,
    typed and checked (`where`: which file set a key, for the sentence; `settings.Sources`)."""
    _check_notify(cfg)  # first: the schema's sentence would repeat the value
    _resolve_everything(cfg)
    settings = Settings.of(cfg, where)  # hpctrain's keys: an unknown one or a wrong value, naming its file
    for key in GROUP_KEYS:  # the groups hpctrain hands on whole: their keys it reads, checked
        value = _value(cfg, key.path)
        if value is _ABSENT:
            continue
        if OmegaConf.is_list(value) or OmegaConf.is_dict(value):
            value = OmegaConf.to_container(value)
        if not validate(value, key.schema):
            shown = value if not isinstance(value, str) else f"'{value}'"
            raise UserError(f"{key.path}={shown} is not {key.expected}; pass e.g. {key.path}={key.example}.")
    check_settings(settings)
    _check_half_adam(cfg, str(settings.trainer.precision))
    _check_loggers(cfg)
    _check_folds(cfg)
    _check_outputs(cfg)
    return settings


def check_settings(settings: Settings) -> None:
    """What the settings alone refuse, whatever else the config holds (tests/pairwise.py asks it too)."""
    _check_precision(settings)
    _check_init_from(settings.init_from)
    _check_signals(settings)


def check_folds(num_folds: Any, fold: Any) -> int | None:
    """The k-fold settings of a datamodule checked: None when k-fold is off (`num_folds` null or 0, no
    `fold`), else the number of folds. Used by the preflight and by the datamodules themselves
    (`hpctrain.data.check_folds`), so a bad pair is the same sentence wherever it is found."""
    if num_folds is not None and (not isinstance(num_folds, Integral) or isinstance(num_folds, bool)):
        raise UserError(f"data.num_folds={num_folds!r} is not an integer; pass e.g. data.num_folds=5.")
    if fold is not None and (not isinstance(fold, Integral) or isinstance(fold, bool)):
        raise UserError(
            f"data.fold={fold!r} is not an integer; pass the fold to validate on, e.g. data.fold=0."
        )
    if not num_folds:
        if fold is not None:
            raise UserError(
                f"data.fold={fold} but data.num_folds is not set, so there are no folds; pass the number of "
                "folds with it (e.g. data.num_folds=5), or leave data.fold out."
            )
        return None
    if num_folds < 2:
        raise UserError(
            f"data.num_folds={num_folds} cannot split the training data into folds; pass 2 or more (e.g. "
            "data.num_folds=5), or null for the datamodule's own train/val split."
        )
    if fold is None:
        raise UserError(
            f"data.num_folds={num_folds} needs data.fold, the fold to validate on; pass data.fold=0 (folds 0 to "
            f"{num_folds - 1}), or sweep them all: -m 'data.fold=range({num_folds})'."
        )
    if not 0 <= fold < num_folds:
        raise UserError(
            f"data.fold={fold} is not a fold of data.num_folds={num_folds}; pass data.fold between 0 and "
            f"{num_folds - 1}."
        )
    return int(num_folds)


def _check_folds(cfg: DictConfig) -> None:
    data = cfg.get("data")
    if OmegaConf.is_dict(data) and ("num_folds" in data or "fold" in data):
        check_folds(data.get("num_folds"), data.get("fold"))


def _check_signals(settings: Settings) -> None:
    """The stacks signal must not be the one that requeues the job (a look at the stacks would requeue it)."""
    stacks_signal = settings.diagnostics.stacks_signal
    requeue_signal = settings.requeue.signal if settings.requeue.enabled else None
    if stacks_signal and stacks_signal == requeue_signal:
        raise UserError(
            f"diagnostics.stacks_signal={stacks_signal} is also requeue.signal, so asking for the stacks would requeue "
            "the job; keep diagnostics.stacks_signal=SIGURG (ignored by processes that do not register it)."
        )


def _check_init_from(init: InitFrom) -> None:
    """`init_from.exclude` or `.prefix` say how to load a weights file: without one they mean a file was
    forgotten (an experiment that fine-tunes, run without init_from.path=...)."""
    for key in ("exclude", "freeze"):  # lists of regular expressions (the schema checked they are lists)
        for pattern in getattr(init, key):
            try:
                re.compile(str(pattern))
            except re.error as err:
                raise UserError(
                    f"init_from.{key} holds {str(pattern)!r}, which is not a regular expression ({err}); escape "
                    f"what is meant literally, e.g. init_from.{key}=['^net[.]fc[.]'] for keys starting with net.fc."
                ) from err
    if init.path:
        return
    for key in ("exclude", "prefix"):
        if getattr(init, key):
            raise UserError(
                f"init_from.{key} is set but init_from.path is not; pass the weights to start from: "
                "init_from.path=<checkpoint, .pt/.pth state dict or .safetensors file>."
            )


def _check_outputs(cfg: DictConfig) -> None:
    """An output file named on the command line that exists already is kept, not overwritten."""
    for key in ("predict.output",):
        output = OmegaConf.select(cfg, key)
        if output and Path(str(output)).expanduser().exists():
            raise UserError(
                f"{key}={output} exists already and is not overwritten; remove it or choose another file."
            )
