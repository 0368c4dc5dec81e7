"""The FLOPs of one training step, counted once, and the device's peak FLOP/s, for the MFU.

The count runs on a copy of the model on the meta device, built from the run's config (Lightning's
`measure_flops`: no memory, no time, and every kernel counted as on a GPU; torch's counter on real CPU
tensors misses the CPU attention kernel). The step counted is the forward pass of `training_step` (its
loss), else of `forward` on the batch's first tensor, and the backward pass. Where no meta copy can be
built or run (a model that reads files in its constructor, metrics that look at values), the first
real step is counted as it runs (torch's counter changes nothing in it), with a warning naming what
the counter did not count.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning_fabric.utilities.throughput import get_available_flops, measure_flops  # namespace-free
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.runtime.config.targets import instantiate
from hpctrain.runtime.namespaces import namespace_of
from hpctrain.runtime.report import gpu_peaks

log = logging.getLogger("hpctrain")

HEAVY_WORDS = ("attention", "conv", "mm", "matmul", "linear", "einsum", "baddbmm")


def meta_step_flops(model_config: Any, batch: Any) -> float | None:
    """FLOPs of one training step (forward and backward) on `batch`, on a meta copy of the model built
    from its config; None when no meta copy can be built or run."""
    if model_config is None:
        return None
    try:
        with torch.device("meta"):
            copy = _instantiate(model_config)
        counted = _measure(copy, _on_meta(batch))
    except Exception as err:  # a model the meta device cannot build or run
        log.debug("FLOPs on a meta copy failed: %s", err)
        return None
    return float(counted) or None


def _instantiate(model_config: Any) -> Any:
    return instantiate(model_config, _convert_="all")


def _on_meta(batch: Any) -> Any:
    """The batch with each tensor replaced by an empty one of its shape on the meta device."""
    if isinstance(batch, torch.Tensor):
        return torch.empty_like(batch, device="meta")
    if isinstance(batch, (list, tuple)):
        if hasattr(batch, "_fields"):  # a named tuple takes its fields as arguments
            return type(batch)(*map(_on_meta, batch))
        return type(batch)(_on_meta(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _on_meta(v) for k, v in batch.items()}
    return batch


def _loss_of(module: Any, batch: Any) -> Callable[[], Any]:
    """The forward pass to count: training_step's loss, else forward on the batch's first tensor."""

    def step() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a trainer
            out = module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError("training_step returned no loss tensor")
        return loss

    def forward() -> Any:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        return module(first).float().sum()

    has_step = type(module).training_step is not getattr(_lightning_base(module), "training_step", None)
    return step if has_step else forward


def _lightning_base(module: Any) -> Any:
    """The LightningModule class of the module's namespace (None for a module of neither)."""
    namespace = namespace_of(module)
    return namespace.get("pytorch_lightning.LightningModule") if namespace else None


def _measure(module: Any, batch: Any) -> int:
    module.train()
    try:
        return measure_flops(module, _loss_of(module, batch), lambda loss: loss)
    except Exception:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        return measure_flops(module, lambda: module(first), lambda out: out.float().sum())


class RealStepCounter:
    """Torch's counter around the first real training step (entered at its start, left at its end):
    nothing about the step changes, it only runs slower once. Remembers the heavy operators the counter
    has no formula for (on CPUs, the attention kernel)."""

    def __init__(self) -> None:
        missed: set[str] = set()
        self.missed = missed

        class Counter(FlopCounterMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = func.overloadpacket.__name__
                if func.overloadpacket not in self.flop_registry and any(w in name for w in HEAVY_WORDS):
                    missed.add(name)
                return super().__torch_dispatch__(func, types, args, kwargs)

        self._counter = Counter(display=False)
        self._counter.__enter__()
        self._open = True

    def stop(self) -> float | None:
        """Leave the counter; the step's FLOPs (a warning names what was not counted)."""
        if not self._open:
            return None
        self._open = False
        self._counter.__exit__(None, None, None)
        if self.missed:
            log.warning(
                "FLOPs counted on the first real step, where torch's counter does not count %s: the FLOP/s "
                "and MFU logged are low by their share",
                ", ".join(sorted(self.missed)),
            )
        return float(self._counter.get_total_flops()) or None


def peak_flops(trainer: Any, override: float | None) -> float | None:
    """The device's peak FLOP/s at the run's precision: `override` where given, else hpctrain's table
    (`gpu_peaks`: the GPUs of the shipped cluster presets), else Lightning's; None on CPUs."""
    if override:
        return float(override)
    device = trainer.strategy.root_device
    if device.type != "cuda":
        return None

    precision = str(trainer.precision)
    dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
    name = torch.cuda.get_device_name(device)
    found: float | None = gpu_peaks.peak_flops(name, _matmul_dtype(dtype, device))
    if found is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = get_available_flops(device, dtype)
    if found is None:
        log.warning(
            "the peak FLOP/s of %s at %s is in neither hpctrain's table nor Lightning's: no MFU is logged; "
            "set callbacks.performance.peak_flops=<FLOP/s per device> for one",
            name,
            precision,
        )
    return float(found) if found else None


def _matmul_dtype(dtype: Any, device: Any) -> str:
    """The row of `gpu_peaks` a run's matmuls run at: float32 runs on TF32 tensor cores on Ampere and
    later unless torch's float32 matmul precision is `highest` (as Lightning's table reads it)."""
    if dtype is torch.bfloat16:
        return "bf16"
    if dtype is torch.float16:
        return "fp16"
    ampere = torch.cuda.get_device_capability(device)[0] >= 8
    return "tf32" if ampere and torch.get_float32_matmul_precision() != "highest" else "fp32"
