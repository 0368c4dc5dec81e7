"""What a run prints for its user: a summary of its config (or the whole tree) and a slow-precision warning
at the start, where the outputs went at the end."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich import print as rich_print
from rich.syntax import Syntax
from rich.tree import Tree

from hpctrain.runtime.config import redact
from hpctrain.runtime.config.settings import Extras
from hpctrain.runtime.environment import launched
from hpctrain.runtime.namespaces import DECLARED, NAMESPACES, namespace_of
from hpctrain.runtime.report.plots import plot_run

log = logging.getLogger("hpctrain")

FIRST = ("data", "model", "trainer", "callbacks", "logger", "paths")


def apply_extras(cfg: DictConfig, extras: Extras, options: dict[str, str] | None = None) -> None:
    """Lightning's notices, warnings and the config printed as `extras` asks; `options`: the groups a
    reader composed from its checkpoint's proposal, shown instead of its own config's."""
    quiet_lightning()
    if extras.ignore_warnings:
        warnings.filterwarnings("ignore")
    if not launched.is_rank_zero() or extras.print_config is False:
        return
    if extras.print_config == "summary":
        choices, overrides = _hydra_choices_and_overrides()
        if options:
            proposed = {g.split("/")[0] for g in options}
            choices = {**{g: o for g, o in choices.items() if g.split("/")[0] not in proposed}, **options}
        log.info("%s", "\n".join(config_summary(cfg, choices, overrides)))
    else:  # full (or true, its name before 0.4)
        print_config(cfg)


# CPU flags of native bf16 arithmetic (/proc/cpuinfo): x86's AVX512-BF16 and AMX, Arm's BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags, or None where the system does not list them (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    return {
        flag
        for line in text.splitlines()
        if line.startswith(("flags", "Features"))
        for flag in line.split(":", 1)[-1].split()
    }


def emulated_bf16_note(precision: str, on_cpu: bool, flags: set[str] | None) -> str | None:
    """A sentence when bf16 would run emulated on this CPU (a single step can take minutes), else None.

    Where the flags are unknown nothing is said: a warning that may be wrong is worse than none.
    """
    if not on_cpu or not precision.startswith("bf16") or flags is None or flags & NATIVE_BF16_FLAGS:
        return None
    return (
        f"trainer.precision={precision} on a CPU without native bf16 (AMX/AVX512-BF16) runs in emulation, "
        "many times slower; pass trainer.precision=32-true for a quick try on this machine."
    )


def emulated_bf16_gpu_note(
    precision: str, gpu: str | None, capability: tuple[int, int] | None, sharded: bool = False
) -> str | None:
    """A sentence when bf16 would run emulated on this GPU: before Ampere (compute capability 8.0; a V100,
    a T4, an RTX 8000) there are no bfloat16 units, and torch emulates them, slower than float16. Its
    advice must run: under FSDP2 (`sharded`) Lightning refuses 16-mixed, which needs loss scaling."""
    if gpu is None or capability is None or not precision.startswith("bf16") or capability >= (8, 0):
        return None
    major, minor = capability
    advice = (
        "pass trainer.precision=32-true (FSDP2 in Lightning has no float16 mixed precision: it refuses 16-mixed); "
        "a model that fits one GPU trains faster with trainer=ddp trainer.precision=16-mixed."
        if sharded
        else "pass trainer.precision=16-mixed."
    )
    return (
        f"trainer.precision={precision} on {gpu} (compute capability {major}.{minor}), which has no bfloat16 units: "
        f"torch emulates them, slower than float16; {advice}"
    )


def warn_if_bf16_is_emulated(trainer: Any, precision: Any) -> None:
    """Say once, at the start, when the trainer's CPU or GPU would emulate the configured bf16 precision."""
    namespace = namespace_of(trainer) or DECLARED  # the trainer's: its classes are what it holds
    accelerators = namespace.get("pytorch_lightning.accelerators")
    note = emulated_bf16_note(
        str(precision), isinstance(trainer.accelerator, accelerators.CPUAccelerator), cpu_flags()
    )
    if note is None and isinstance(trainer.accelerator, accelerators.CUDAAccelerator):
        import torch

        model_parallel = namespace.get("pytorch_lightning.strategies.ModelParallelStrategy")
        device = trainer.strategy.root_device
        note = emulated_bf16_gpu_note(
            str(precision),
            torch.cuda.get_device_name(device),
            torch.cuda.get_device_capability(device),
            sharded=isinstance(trainer.strategy, model_parallel),
        )
    if note is not None:
        log.warning(note)


# The groups whose choice the summary names (hydra/*, paths, extras and local say little of the run)
UNSHOWN_GROUPS = ("hydra", "paths", "extras", "local")


def _hydra_choices_and_overrides() -> tuple[dict[str, str], list[str]]:
    """The running Hydra app's group choices and command-line overrides ({} and [] outside one)."""
    try:
        hydra = HydraConfig.get()
    except ValueError:  # not inside a Hydra app (the contract tests build a run directly)
        return {}, []
    choices = {str(k): str(v) for k, v in hydra.runtime.choices.items() if v is not None}
    return choices, [str(o) for o in hydra.overrides.task]


def _class_name(node: Any) -> str | None:
    target = node.get("_target_") if isinstance(node, dict) else None
    return str(target).rsplit(".", 1)[-1] if target else None


def config_summary(cfg: DictConfig, choices: dict[str, str], overrides: list[str]) -> list[str]:
    """A few lines of what the run was composed of: the options chosen, the overrides, the model's and
    data's classes, the trainer's shape, the monitored metric and the run dir, where config.yaml holds
    the whole of it (`extras.print_config=full` prints it here)."""
    shown = redact.recorded(cfg)  # a job's log is a record too: no secret in it
    output_dir = (shown.get("paths") or {}).get("output_dir")
    where = f"{output_dir}/config.yaml" if output_dir else "config.yaml in the run dir"
    lines = [f"config (all of it: {where}; extras.print_config=full prints it here)"]
    chosen = [f"{g}={o}" for g, o in choices.items() if g.split("/")[0] not in UNSHOWN_GROUPS]
    if chosen:
        lines.append(f"  options    {' '.join(chosen)}")
    if overrides:
        lines.append(f"  overrides  {' '.join(redact.override(o) for o in overrides)}")
    model = shown.get("model")
    if isinstance(model, dict) and _class_name(model):
        parts = [f"{k} {_class_name(v)}" for k, v in model.items() if _class_name(v)]
        lines.append(f"  model      {model['_target_']}" + (f" ({', '.join(parts)})" if parts else ""))
    data = shown.get("data")
    if isinstance(data, dict) and _class_name(data):
        sizes = [f"{k} {data[k]}" for k in ("batch_size", "num_workers") if k in data]
        lines.append(f"  data       {data['_target_']}" + (f" ({', '.join(sizes)})" if sizes else ""))
    trainer = shown.get("trainer")
    if isinstance(trainer, dict):
        shape = [
            f"{trainer.get('accelerator', 'auto')} x {trainer.get('devices', 'auto')} device(s) x "
            f"{trainer.get('num_nodes', 1)} node(s)",
            f"strategy {trainer.get('strategy', 'auto')}",
            f"precision {trainer.get('precision', '32-true')}",
        ]
        if trainer.get("max_epochs") is not None:
            shape.append(f"max_epochs {trainer['max_epochs']}")
        if trainer.get("max_steps") not in (None, -1):
            shape.append(f"max_steps {trainer['max_steps']}")
        lines.append(f"  trainer    {', '.join(shape)}")
    monitor = shown.get("monitor")
    if isinstance(monitor, dict) and monitor.get("metric"):
        lines.append(f"  monitor    {monitor['metric']} ({monitor.get('mode', 'max')})")
    if output_dir:
        lines.append(f"  run dir    {output_dir}")
    return lines


def print_config(cfg: DictConfig) -> None:
    tree = Tree("config", guide_style="dim")
    shown = redact.recorded(cfg)  # a job's log is a record too: no secret in it
    keys = [k for k in FIRST if k in shown] + [k for k in shown if k not in FIRST]
    for key in keys:
        branch = tree.add(str(key), style="bold")
        value = shown[key]
        text = OmegaConf.to_yaml(OmegaConf.create(value)) if isinstance(value, dict) else str(value)
        branch.add(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich_print(tree)


def report(run_dir: str, trainer: Any, checkpoint: str | None) -> dict[str, float]:
    """Log a summary of the run (on rank 0) and return its scalar metrics."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if not launched.is_rank_zero():
        return metrics
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
    log.info("processes: %d (process group backend: %s)", trainer.world_size, backend)
    shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k.startswith(("test", "val")))
    log.info("finished: %s", shown or "no metrics")
    if checkpoint:
        kind = "last" if Path(checkpoint).name == "last.ckpt" else "best"  # last: no metric was monitored
        log.info("%s checkpoint: %s", kind, checkpoint)
    if (Path(run_dir) / "metrics.csv").is_file():
        try:
            log.info("curves: %s (python scripts/plot.py %s redraws them)", plot_run(run_dir), run_dir)
        except Exception as err:  # a picture must never fail a finished run
            log.warning("could not plot the curves: %s", err)
    log.info("run dir: %s", run_dir)
    return metrics


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def lightning_logs_once() -> None:
    """The `lightning` package gives its logger a console handler of its own (`INFO: ...`) whatever the
    process has configured, so under Hydra's handlers every line of a `lightning.pytorch` run would be
    printed twice. Its records go to the root's handlers (the console and <task>.log) as pytorch_lightning's
    do (pytorch_lightning adds its handler only when the root has none). Nothing else of its logging changes."""
    if "lightning" not in sys.modules or not logging.getLogger().hasHandlers():
        return
    logger = logging.getLogger("lightning")
    for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
        logger.removeHandler(handler)


def quiet_lightning() -> None:
    """Drop Lightning's advertising and the notices that do not apply here.

    The srun hint is covered by `hpctrain.runtime.environment.launch_checks.preflight`, which fails instead
    of hinting; the non-resumable dataloader notice by `hpctrain.runtime.storage.checkpoints`, which says what
    it means here.
    """
    for namespace in NAMESPACES:  # whichever the run trains with
        logging.getLogger(f"{namespace.package}.utilities.rank_zero").addFilter(
            _DropMessages(("💡 Tip", "Trainer already configured with model summary"))
        )
    # torchao (imported by peft wherever it is installed) registers enums torch now knows: torch's notice
    # of it on every LLM run is for torchao's authors, not for a run
    logging.getLogger("torch.utils._pytree").addFilter(
        _DropMessages(("%s is an Enum subclass and is now natively",))
    )
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings(
        "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
    )
    # A resumed run writes its checkpoints into its own run dir by design (the run dir is the run's
    # identity), so the checkpoint folder always "changes" on resume; the start line names both.
    warnings.filterwarnings("ignore", message="The dirpath has changed from")


def quiet_training_callbacks() -> None:
    """For a job that only tests or predicts with a trained checkpoint (eval, predict): Lightning asks
    to add every callback whose state the checkpoint holds (the template's checkpointing, early stopping
    and exact-resume states among them), which only resuming a fit would use."""
    warnings.filterwarnings(
        "ignore", message="Be aware that when using `ckpt_path`, callbacks used to create"
    )
