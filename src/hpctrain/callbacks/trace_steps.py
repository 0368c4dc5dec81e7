"""Traces on demand (`debug=trace`): torch.profiler over a few training steps of the chosen ranks.

Each traced rank skips `wait` steps, warms the profiler up for `warmup`, records `active`, then writes
into `dirpath` (the run dir's traces/):

- `rank<r>.json`: a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing);
- `rank<r>_top_ops.txt`: the operations that took longest (rank 0 also prints them);
- on GPUs, `rank<r>_memory.pickle`: a CUDA memory snapshot of those steps (drag it onto
  https://pytorch.org/memory_viz).

The profiler is started by each rank for itself, so it works the same under DDP, torchrun and Slurm,
where Lightning's `profiler=pytorch` writes from rank 0's view only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain")


def chosen(ranks: Any, rank: int) -> bool:
    """`all`, one rank, or a list of ranks."""
    if ranks in (None, "all"):
        return True
    if isinstance(ranks, int):
        return rank == ranks
    return rank in [int(r) for r in ranks]


class TraceSteps(LightningPart, lightning="pytorch_lightning.Callback"):
    def __init__(
        self, dirpath: str, wait: int = 1, warmup: int = 1, active: int = 3, ranks: Any = "all", top: int = 15
    ) -> None:
        self.dirpath = Path(dirpath)
        self.wait, self.warmup, self.active = int(wait), int(warmup), int(active)
        self.ranks = ranks
        self.top = int(top)
        self._profiler: Any = None
        self._rank = 0
        self._cuda = False
        self.written: list[Path] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rank = trainer.global_rank
        if not chosen(self.ranks, self._rank):
            return

        self._cuda = trainer.strategy.root_device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self.dirpath.mkdir(parents=True, exist_ok=True)
        if self._cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._ready,
        )
        self._profiler.start()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # a run shorter than the schedule: what was recorded is written now

    def _ready(self, profiler: Any) -> None:
        rank = self._rank
        trace = self.dirpath / f"rank{rank}.json"
        profiler.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if self._cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.top)
        top = self.dirpath / f"rank{rank}_top_ops.txt"
        top.write_text(table + "\n")
        self.written += [trace, top]
        if self._cuda:
            snapshot = self.dirpath / f"rank{rank}_memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snapshot)
        log.info("trace of rank %d's steps: %s", rank, trace)
        if rank == 0:
            log.info("rank 0's top operations over the traced steps:\n%s", table)
        self._profiler = None if self._profiler is profiler else self._profiler
