"""The FLOPs of one training step, counted once, and the device's peak FLOP/s, for the MFU.

The count is taken on the first real training step, as it runs (torch's counter changes nothing in it,
it only makes that step slower once): no copy of the model is built, so nothing of the user's code runs
again (a constructor that reads files, downloads or counts would do it twice). A module that knows its
own count (`flops_per_batch(batch)`: a transformer's from its shape) is asked instead. On CPUs torch's
counter has no formula for its fused attention kernel: it is counted here as on a GPU.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from lightning_fabric.utilities.throughput import get_available_flops  # namespace-free
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hpctrain.runtime.report import gpu_peaks

log = logging.getLogger("hpctrain")

_ATEN = torch.ops.aten
# CPU attention (scaled_dot_product_attention's fused kernel on CPUs), counted as its GPU kernels are
CPU_ATTENTION = {
    _ATEN._scaled_dot_product_flash_attention_for_cpu: (
        lambda query, key, value, *args, **kwargs: sdpa_flop_count(query, key, value)
    ),
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, query, key, value, *args, **kwargs: sdpa_backward_flop_count(grad, query, key, value)
    ),
}


class RealStepCounter:
    """Torch's counter around the first real training step (entered at its start, left at its end)."""

    def __init__(self) -> None:
        self._counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
        self._counter.__enter__()
        self._open = True

    def stop(self) -> float | None:
        """Leave the counter; the step's FLOPs (None where it counted none)."""
        if not self._open:
            return None
        self._open = False
        self._counter.__exit__(None, None, None)
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
