"""What progress and throughput figures are made of: a batch's size, the time since the process started.

The callbacks that show them are `hpctrain.callbacks.progress_bar` and `hpctrain.callbacks.throughput_log`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pytorch_lightning.utilities.data import extract_batch_size  # namespace-free
from torch import Tensor


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0].shape[0]
    return extract_batch_size(batch)


def tokens_of(batch: Any) -> Tensor | None:
    """The tokens a loss is taken on in a token batch (a mapping with `labels`, -100 where none is taken,
    the first position predicting nothing), as a tensor on the batch's device; None for other batches."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        return None
    return (labels[:, 1:] != -100).sum()


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux), so startup cost includes the interpreter and imports.

    /proc/self/stat gives the start in clock ticks since boot, the clock CLOCK_BOOTTIME reads.
    """
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
