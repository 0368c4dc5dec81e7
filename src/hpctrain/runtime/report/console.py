"""What a run prints for its user: the config tree and a slow-precision warning at the start, where the
outputs went at the end."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich import print as rich_print
from rich.syntax import Syntax
from rich.tree import Tree

from hpctrain.runtime.config import redact
from hpctrain.runtime.config.settings import Extras
from hpctrain.runtime.environment import launched
from hpctrain.runtime.namespaces import NAMESPACES, namespace_of
from hpctrain.runtime.report.plots import plot_run

log = logging.getLogger("hpctrain")

FIRST = ("data", "model", "trainer", "callbacks", "logger", "paths")


def apply_extras(cfg: DictConfig, extras: Extras) -> None:
    quiet_lightning()
    if extras.ignore_warnings:
        warnings.filterwarnings("ignore")
    if extras.print_config and launched.is_rank_zero():
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


def emulated_bf16_gpu_note(precision: str, gpu: str | None, capability: tuple[int, int] | None) -> str | None:
    """A sentence when bf16 would run emulated on this GPU: before Ampere (compute capability 8.0; a V100,
    a T4, an RTX 8000) there are no bfloat16 units, and torch emulates them, slower than float16."""
    if gpu is None or capability is None or not precision.startswith("bf16") or capability >= (8, 0):
        return None
    major, minor = capability
    return (
        f"trainer.precision={precision} on {gpu} (compute capability {major}.{minor}), which has no bfloat16 units: "
        "torch emulates them, slower than float16; pass trainer.precision=16-mixed (and, under FSDP2, "
        "dist.fsdp.param_dtype=float16)."
    )


def warn_if_bf16_is_emulated(trainer: Any, precision: Any) -> None:
    """Say once, at the start, when the trainer's CPU or GPU would emulate the configured bf16 precision."""
    accelerators = namespace_of(trainer).get("pytorch_lightning.accelerators")  # the trainer's namespace's
    note = emulated_bf16_note(
        str(precision), isinstance(trainer.accelerator, accelerators.CPUAccelerator), cpu_flags()
    )
    if note is None and isinstance(trainer.accelerator, accelerators.CUDAAccelerator):
        import torch

        device = trainer.strategy.root_device
        note = emulated_bf16_gpu_note(
            str(precision), torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        )
    if note is not None:
        log.warning(note)


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
    of hinting; the non-resumable dataloader notice by `hpctrain.runtime.run.checkpoints`, which says what
    it means here.
    """
    for namespace in NAMESPACES:  # whichever the run trains with
        logging.getLogger(f"{namespace.package}.utilities.rank_zero").addFilter(
            _DropMessages(("💡 Tip", "Trainer already configured with model summary"))
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
