"""`PerformanceLog` (the `callbacks` group's performance): where a training step's time goes, on every
rank. What it measures and logs: `hpctrain.runtime.report.performance`."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.distributed import job_store
from hpctrain.runtime.namespaces import LightningPart
from hpctrain.runtime.report import flops as flop_count
from hpctrain.runtime.report import gpus
from hpctrain.runtime.report.performance import (
    FINAL_WAIT_S,
    PERF_KEY,
    RankMeter,
    figures,
    input_bound_warning,
    metrics,
    node_spreads,
    read_sums,
    reset_peak_memory,
    rounded,
    slowest_input,
    summary_line,
    tensor_parallel,
)
from hpctrain.runtime.report.progress import batch_size_of

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer

log = logging.getLogger("hpctrain")


class PerformanceLog(LightningPart, lightning="pytorch_lightning.Callback"):
    """See the module docstring. `peak_flops`: the device's peak FLOP/s for the MFU, where Lightning's
    table does not know it (or to override it); `flops=false` skips counting the FLOPs of a step;
    `gpu_every_s`: how often local rank 0 samples its node's GPUs through NVML (0: never)."""

    def __init__(
        self,
        data_wait_warn: float = 0.2,
        every_n_steps: int | None = None,
        flops: bool = True,
        peak_flops: float | None = None,
        gpu_every_s: float = 5.0,
    ) -> None:
        self.data_wait_warn = float(data_wait_warn)
        self.every_n_steps = every_n_steps
        self.count_flops = bool(flops)
        self.peak_flops = peak_flops
        self.gpu_every_s = float(gpu_every_s)
        self.meter = RankMeter()
        self.summary: dict[str, Any] = {}
        self._every = 50
        self._previous: dict[int, dict[str, Any]] = {}
        self._hosts: dict[int, str] = {}
        self._windows = 0
        self._warned = False
        self._flops_per_sample: float | None = None
        self._peak: float | None = None
        self._sampler: gpus.NodeSampler | None = None
        self._flops_done = False
        self._real_counter: flop_count.RealStepCounter | None = None

    # --- hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        root = trainer.strategy.root_device
        self.meter = RankMeter(root if root.type == "cuda" else None)
        self._every = max(1, int(self.every_n_steps or trainer.log_every_n_steps or 50))
        if self.gpu_every_s > 0 and trainer.local_rank == 0 and root.type == "cuda":
            self._sampler = gpus.NodeSampler.start(self.gpu_every_s, job_store.store())

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._real_counter is not None:  # the first step failed
            self._real_counter.stop()
            self._real_counter = None
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        reset_peak_memory(self.meter.device)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._flops_done:
            self._flops_done = True
            self._count_flops(trainer, batch, pl_module)
        self.meter.step_started()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.step_ended(batch_size_of(batch))
        if self._real_counter is not None:
            self._flops_counted(self._real_counter.stop(), batch)
            self._real_counter = None
        if self.meter.steps % self._every == 0:
            self._interval(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.meter.paused()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.meter.paused()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sums = self._gathered(trainer, "/final", wait_s=FINAL_WAIT_S)
        if sums is None:
            return
        self.summary = self._run_summary(sums, tensor_parallel(trainer))
        if self.summary:
            log.info(summary_line(self.summary, trainer.strategy.root_device.type))

    # --- the log interval
    def _gathered(
        self, trainer: Trainer, suffix: str, wait_s: float = 0.0
    ) -> dict[int, dict[str, Any]] | None:
        """This rank's sums into the job's store; on rank 0, every rank's sums (None on the others)."""
        mine = self.meter.sums()
        store = job_store.store()
        if store is not None and not trainer.is_global_zero:  # rank 0 reads its own from memory
            store.set(f"{PERF_KEY}/{trainer.global_rank}{suffix}", json.dumps(mine))
        if not trainer.is_global_zero:
            return None
        return {0: mine, **read_sums(store, trainer.world_size, suffix, wait_s=wait_s)}

    def _interval(self, trainer: Trainer) -> None:
        sums = self._gathered(trainer, "")
        if sums is None:
            return
        store = job_store.store()
        per_rank = {}
        for r, now in sums.items():
            self._hosts[r] = now["host"]
            window = figures(now, self._previous.get(r))
            if window is not None:
                per_rank[r] = window
            self._previous[r] = now
        found = metrics(per_rank, self._hosts, self._flops_per_sample, self._peak, tensor_parallel(trainer))
        if self.meter.device is not None:  # GPUs: every node's latest NVML sample
            found.update(gpus.read(store, self._sampler))
        if found:
            for logger in trainer.loggers:
                logger.log_metrics(found, step=trainer.global_step)
        self._windows += 1
        if self._windows > 1 and not self._warned:  # the first window holds the loader workers' start
            slow = slowest_input(per_rank, self.data_wait_warn)
            if slow is not None:
                self._warned = True
                r, share = slow
                several = trainer.world_size > 1
                log.warning(
                    input_bound_warning(r, self._hosts.get(r, "?"), share, self.data_wait_warn, several)
                )

    def _run_summary(self, sums: dict[int, dict[str, Any]], tensor_parallel: int = 1) -> dict[str, Any]:
        per_rank = {r: f for r, s in sums.items() if (f := figures(s, None)) is not None}
        if not per_rank:
            return {}
        hosts = {r: s["host"] for r, s in sums.items()}
        job = metrics(per_rank, hosts, self._flops_per_sample, self._peak, tensor_parallel)
        summary: dict[str, Any] = {
            k.split("/", 1)[1]: rounded(v) for k, v in job.items() if k.startswith("perf/")
        }
        if self._flops_per_sample:
            summary["flops_per_sample"] = int(self._flops_per_sample)
        if len(per_rank) > 1:
            summary["ranks"] = {
                r: {
                    "host": sums[r]["host"],
                    "steps": sums[r]["steps"],
                    **{k: rounded(v) for k, v in per_rank[r].items()},
                }
                for r in sorted(per_rank)
            }
            summary["nodes"] = {
                host: {name: {k: rounded(v) for k, v in spread.items()} for name, spread in spreads.items()}
                for host, spreads in node_spreads(per_rank, hosts).items()
            }
        return summary

    def _count_flops(self, trainer: Trainer, batch: Any, pl_module: LightningModule | None = None) -> None:
        """Once, on rank 0: the FLOPs of one training step (the module's own count, `flops_per_batch(batch)`,
        where it has one: a transformer's from its shape; else the first real step's, as it runs), and the
        device's peak FLOP/s."""
        if not (self.count_flops and trainer.is_global_zero):
            return
        self._peak = flop_count.peak_flops(trainer, self.peak_flops)
        own = getattr(pl_module, "flops_per_batch", None)
        if callable(own):
            self._flops_counted(float(own(batch)), batch)
        else:
            self._real_counter = flop_count.RealStepCounter()

    def _flops_counted(self, counted: float | None, batch: Any) -> None:
        size = batch_size_of(batch)
        if counted and size:
            self._flops_per_sample = counted / size
