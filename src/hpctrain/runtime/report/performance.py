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

import torch

from hpctrain.runtime.distributed import job_store
from hpctrain.runtime.environment import launched

log = logging.getLogger("hpctrain")


PERF_KEY = "hpctrain/perf"  # + /<rank>: this rank's running sums (json); + /<rank>/final at the end
FIGURES = ("data_wait", "step_ms", "samples_per_s", "peak_mem_mib")
FINAL_WAIT_S = 30.0  # how long rank 0 waits at the end for the other ranks' last figures


# ------------------------------------------------------------------------- memory


def reset_peak_memory(device: Any) -> None:
    """Start the peak from now: CUDA's allocator statistics, or Linux's high-water mark of the
    process's resident memory (`echo 5 > /proc/self/clear_refs`)."""
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)
        return
    with suppress(OSError):  # not Linux, or not allowed: the peak since the process started
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mib(device: Any) -> float:
    """CUDA's peak allocated memory on a GPU; the process's peak resident memory on a CPU."""
    if device is not None:
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


def tensor_parallel(trainer: Any) -> int:
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


def read_sums(store: Any, world_size: int, suffix: str, wait_s: float = 0.0) -> dict[int, dict[str, Any]]:
    """The other ranks' latest sums in the store (those that have published), without blocking; at the
    end, waiting up to `wait_s` for all of them.

    Two requests once every rank has published (whether all are there, then all of them at once), not
    two per rank: rank 0 asks at every log interval, on its training thread, and with 80 ranks a request
    per key was 160 round trips to the store. One per rank only until every rank published once."""
    if store is None or world_size < 2:
        return {}
    keys = [f"{PERF_KEY}/{r}{suffix}" for r in range(1, world_size)]
    if wait_s:
        with suppress(Exception):  # a rank that ended early: what the others published
            store.wait(keys, timedelta(seconds=wait_s))
    with suppress(Exception):
        if store.check(keys):
            return {r: json.loads(raw) for r, raw in enumerate(store.multi_get(keys), start=1)}
    found = {}
    for r, key in enumerate(keys, start=1):
        try:
            if store.check([key]):
                found[r] = json.loads(store.get(key))
        except Exception:
            continue
    return found


def rounded(value: float) -> float:
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
