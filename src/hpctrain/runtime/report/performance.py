"""Where a training step's time goes, on every rank: waiting for data, the step itself, samples per
second, peak memory, the FLOP/s achieved and (on GPUs with a known peak) the MFU.

Per step, each rank only reads the host clock twice (and on a GPU records two CUDA events, which does
not wait for the device). At the log interval (`trainer.log_every_n_steps`, or `every_n_steps`) each
rank reads its events once, puts its running sums into the job's store (no collective: a rank that is
late is reported a window later, never waited for), and rank 0, whose loggers are the ones that write,
logs the window since its last look:

- `perf/samples_per_s` (all ranks), `perf/data_wait` (the mean share of training time spent waiting for
  the next batch), `perf/step_ms` (median), `perf/peak_mem_mib` (max), `perf/tflops_per_device`,
  `perf/mfu` (where the device's peak is known);
- under several ranks, each rank's own figures `ranks/<figure>/<rank>` and each node's
  `nodes/<host>/<figure>_min|_median|_max`.

"Waiting for data" is the time from the end of one training step to the start of the next, validation
and checkpointing excepted: the loader's next batch, its transfer to the device, the batch-start hooks.
On a GPU it is the device's idle time between the two steps (CUDA events): the host runs ahead of the
device, and a host waiting for a busy device (a full launch queue, a copy behind the last kernels) is
no wait for data; the device idling between steps is.
A rank whose share is above `data_wait_warn` (default 20 %) after the first window gets one warning with
the fixes. The whole run's figures go to outcome.yaml (`performance:`) and one log line.
"""

from __future__ import annotations

import json
import logging
import resource
import statistics
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

from pytorch_lightning import Callback, LightningModule, Trainer

from hpctrain.runtime.distributed import job_store
from hpctrain.runtime.environment import launched
from hpctrain.runtime.report import flops as flop_count
from hpctrain.runtime.report import gpus
from hpctrain.runtime.report.progress import batch_size_of

log = logging.getLogger("hpctrain")

PERF_KEY = "hpctrain/perf"  # + /<rank>: this rank's running sums (json); + /<rank>/final at the end
FIGURES = ("data_wait", "step_ms", "samples_per_s", "peak_mem_mib")
FINAL_WAIT_S = 30.0  # how long rank 0 waits at the end for the other ranks' last figures


# ------------------------------------------------------------------------- memory


def reset_peak_memory(device: Any) -> None:
    """Start the peak from now: CUDA's allocator statistics, or Linux's high-water mark of the
    process's resident memory (`echo 5 > /proc/self/clear_refs`)."""
    if device is not None:
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    with suppress(OSError):  # not Linux, or not allowed: the peak since the process started
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mib(device: Any) -> float:
    """CUDA's peak allocated memory on a GPU; the process's peak resident memory on a CPU."""
    if device is not None:
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------------- one rank


class RankMeter:
    """This rank's running sums, kept by the training thread with host clocks (see the module
    docstring); on a GPU also the device's own time per step, from CUDA events read at the interval."""

    def __init__(self, device: Any = None, event: Any = None) -> None:
        self.device = device  # a CUDA device, or None on CPUs
        self.steps = 0
        self.samples = 0
        self.wait_s = 0.0
        self.host_step_s = 0.0
        self.device_step_s = 0.0
        self.device_wait_s = 0.0
        self._started = 0.0
        self._ended: float | None = None
        self._events: list[list[Any]] = []  # [start, end] of each step not read yet
        self._gaps: list[list[Any]] = []  # [the previous step's end, this step's start]
        self._last_end: Any = None  # the previous step's end event
        self._event = event  # makes a timing event; torch.cuda.Event by default (tests give their own)

    def _record(self) -> Any:
        if self._event is None:
            import torch

            self._event = lambda: torch.cuda.Event(enable_timing=True)
        event = self._event()
        event.record()
        return event

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._ended is not None:
            self.wait_s += now - self._ended
        self._started = now
        if self.device is not None:
            start = self._record()
            if self._ended is not None and self._last_end is not None:
                self._gaps.append([self._last_end, start])
            self._events.append([start, None])

    def step_ended(self, samples: int) -> None:
        now = time.perf_counter()
        self.host_step_s += now - self._started
        self.steps += 1
        self.samples += samples
        self._ended = now
        if self._events:
            self._events[-1][1] = self._last_end = self._record()

    def paused(self) -> None:
        """Validation, checkpointing or the epoch's end follow: the next gap is not a wait for data."""
        self._ended = None

    def sums(self) -> dict[str, Any]:
        """The running sums, with the CUDA events recorded so far read (the one device sync, here)."""
        done = [pair for pair in self._events if pair[1] is not None]
        if done:
            done[-1][1].synchronize()
            self.device_step_s += sum(start.elapsed_time(end) for start, end in done) / 1000
            self.device_wait_s += sum(end.elapsed_time(start) for end, start in self._gaps) / 1000
            self._events = [pair for pair in self._events if pair[1] is None]
            self._gaps = []
        on_device = self.device is not None
        return {
            "steps": self.steps,
            "samples": self.samples,
            "wait_s": self.device_wait_s if on_device else self.wait_s,
            "step_s": self.device_step_s if on_device else self.host_step_s,
            "wall_s": self.device_wait_s + self.device_step_s
            if on_device
            else self.wait_s + self.host_step_s,
            "peak_mem_mib": peak_memory_mib(self.device),
            "host": launched.node_name().split(".")[0],
        }


# ------------------------------------------------------------------------- rank 0's view


def figures(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, float] | None:
    """One rank's figures over the window between two of its sums (the whole run when `before` is None)."""
    before = before or {}
    steps = now["steps"] - before.get("steps", 0)
    wall = now["wall_s"] - before.get("wall_s", 0.0)
    if steps <= 0 or wall <= 0:
        return None
    return {
        "data_wait": (now["wait_s"] - before.get("wait_s", 0.0)) / wall,
        "step_ms": 1000 * (now["step_s"] - before.get("step_s", 0.0)) / steps,
        "samples_per_s": (now["samples"] - before.get("samples", 0)) / wall,
        "peak_mem_mib": now["peak_mem_mib"],
    }


def metrics(
    per_rank: dict[int, dict[str, float]],
    hosts: dict[int, str],
    flops_per_sample: float | None,
    peak: float | None,
    tensor_parallel: int = 1,
) -> dict[str, float]:
    """What rank 0 logs for one window: the job's figures, and under several ranks each rank's and each
    node's (see the module docstring). Under tensor parallelism the `tensor_parallel` ranks of a group
    train the same samples, each with its share of the FLOPs: the job's samples are counted once per
    group, and each device's FLOP/s is its share."""
    if not per_rank:
        return {}
    ranks = sorted(per_rank)
    out = {
        "perf/samples_per_s": sum(per_rank[r]["samples_per_s"] for r in ranks) / tensor_parallel,
        "perf/data_wait": statistics.fmean(per_rank[r]["data_wait"] for r in ranks),
        "perf/step_ms": statistics.median(per_rank[r]["step_ms"] for r in ranks),
        "perf/peak_mem_mib": max(per_rank[r]["peak_mem_mib"] for r in ranks),
    }
    if flops_per_sample:
        achieved = (
            statistics.fmean(flops_per_sample * per_rank[r]["samples_per_s"] for r in ranks) / tensor_parallel
        )
        out["perf/tflops_per_device"] = achieved / 1e12
        if peak:
            out["perf/mfu"] = achieved / peak
    if len(ranks) > 1:
        for r in ranks:
            out.update({f"ranks/{name}/{r}": per_rank[r][name] for name in FIGURES})
        for host, spreads in node_spreads(per_rank, hosts).items():
            for name, spread in spreads.items():
                out.update({f"nodes/{host}/{name}_{k}": v for k, v in spread.items()})
    return out


def _tensor_parallel(trainer: Any) -> int:
    """The processes of a tensor-parallel group (1 without one): the world over the data-parallel group."""
    shared = job_store.data_parallel()
    world = getattr(trainer, "world_size", 1) if trainer is not None else 1
    return max(1, world // shared[0]) if shared else 1


def node_spreads(
    per_rank: dict[int, dict[str, float]], hosts: dict[int, str]
) -> dict[str, dict[str, dict[str, float]]]:
    """host -> figure -> {min, median, max} over that node's ranks."""
    return {
        host: {
            name: {
                "min": min(f[name] for f in of),
                "median": statistics.median(f[name] for f in of),
                "max": max(f[name] for f in of),
            }
            for name in FIGURES
        }
        for host, of in _by_node(per_rank, hosts).items()
    }


def _by_node(
    per_rank: dict[int, dict[str, float]], hosts: dict[int, str]
) -> dict[str, list[dict[str, float]]]:
    nodes: dict[str, list[dict[str, float]]] = {}
    for r in sorted(per_rank):
        nodes.setdefault(hosts.get(r, "?"), []).append(per_rank[r])
    return nodes


def slowest_input(per_rank: dict[int, dict[str, float]], threshold: float) -> tuple[int, float] | None:
    """The rank that waited longest for data, when its share is above `threshold`."""
    if not per_rank:
        return None
    rank = max(per_rank, key=lambda r: per_rank[r]["data_wait"])
    share = per_rank[rank]["data_wait"]
    return (rank, share) if share > threshold else None


def input_bound_warning(rank: int, host: str, share: float, threshold: float, several: bool) -> str:
    who = f"rank {rank} ({host})" if several else "this run"
    return (
        f"input-bound: {who} spent {100 * share:.0f}% of its training time waiting for the next batch "
        f"(callbacks.performance.data_wait_warn={threshold}): give the loader workers (data.num_workers), "
        "read from node-local disk (data=shards with data.stage_dir, staged once per node), or pack small "
        "files into shards (scripts/make_shards.py)"
    )


# ------------------------------------------------------------------------- the callback


class PerformanceLog(Callback):
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
        self.model_config: Any = None  # set by the build: the model's config, for the FLOPs on a meta copy
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
            self._count_flops(trainer, batch)
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
        self.summary = self._run_summary(sums, _tensor_parallel(trainer))
        if self.summary:
            log.info(summary_line(self.summary, trainer.strategy.root_device.type))

    # --- the log interval
    def _gathered(
        self, trainer: Trainer, suffix: str, wait_s: float = 0.0
    ) -> dict[int, dict[str, Any]] | None:
        """This rank's sums into the job's store; on rank 0, every rank's sums (None on the others)."""
        mine = self.meter.sums()
        store = job_store.store()
        if store is not None:
            store.set(f"{PERF_KEY}/{trainer.global_rank}{suffix}", json.dumps(mine))
        if not trainer.is_global_zero:
            return None
        return {0: mine, **_read(store, trainer.world_size, suffix, wait_s=wait_s)}

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
        found = metrics(per_rank, self._hosts, self._flops_per_sample, self._peak, _tensor_parallel(trainer))
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
            k.split("/", 1)[1]: _round(v) for k, v in job.items() if k.startswith("perf/")
        }
        if self._flops_per_sample:
            summary["flops_per_sample"] = int(self._flops_per_sample)
        if len(per_rank) > 1:
            summary["ranks"] = {
                r: {
                    "host": sums[r]["host"],
                    "steps": sums[r]["steps"],
                    **{k: _round(v) for k, v in per_rank[r].items()},
                }
                for r in sorted(per_rank)
            }
            hosts = {r: s["host"] for r, s in sums.items()}
            summary["nodes"] = {
                host: {name: {k: _round(v) for k, v in spread.items()} for name, spread in spreads.items()}
                for host, spreads in node_spreads(per_rank, hosts).items()
            }
        return summary

    def _count_flops(self, trainer: Trainer, batch: Any) -> None:
        """Once, on rank 0: the FLOPs of one training step (a meta copy, else the first real step as it
        runs), and the device's peak FLOP/s."""
        if not (self.count_flops and trainer.is_global_zero):
            return
        self._peak = flop_count.peak_flops(trainer, self.peak_flops)
        counted = flop_count.meta_step_flops(self.model_config, batch)
        if counted is not None:
            self._flops_counted(counted, batch)
        else:
            self._real_counter = flop_count.RealStepCounter()

    def _flops_counted(self, counted: float | None, batch: Any) -> None:
        size = batch_size_of(batch)
        if counted and size:
            self._flops_per_sample = counted / size


def _read(store: Any, world_size: int, suffix: str, wait_s: float = 0.0) -> dict[int, dict[str, Any]]:
    """The other ranks' latest sums in the store (those that have published), without blocking; at the
    end, waiting up to `wait_s` for all of them."""
    if store is None or world_size < 2:
        return {}
    keys = [f"{PERF_KEY}/{r}{suffix}" for r in range(1, world_size)]
    if wait_s:
        with suppress(Exception):  # a rank that ended early: what the others published
            store.wait(keys, timedelta(seconds=wait_s))
    found = {}
    for r, key in enumerate(keys, start=1):
        try:
            if store.check([key]):
                found[r] = json.loads(store.get(key))
        except Exception:
            continue
    return found


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def summary_line(summary: dict[str, Any], device_type: str) -> str:
    parts = [
        f"{summary['samples_per_s']:.0f} samples/s",
        f"data wait {100 * summary['data_wait']:.0f}%",
        f"step {summary['step_ms']:.1f} ms (median rank)",
        f"peak memory {summary['peak_mem_mib']:.0f} MiB (largest rank)",
    ]
    if "tflops_per_device" in summary:
        parts.append(f"{summary['tflops_per_device']:.3g} TFLOP/s per device")
    if "mfu" in summary:
        parts.append(f"MFU {100 * summary['mfu']:.1f}%")
    elif device_type == "cpu" and "tflops_per_device" in summary:
        parts.append(
            "MFU not reported on CPUs (no known peak; callbacks.performance.peak_flops=<FLOP/s> sets one)"
        )
    return "performance: " + ", ".join(parts)
