"""GPU utilisation, memory and power from NVML (`nvidia-ml-py`), sampled by local rank 0 of each node.

A thread samples every GPU of its node every `callbacks.performance.gpu_every_s` seconds and puts the
latest figures in the job's store; global rank 0 logs every node's at the log interval as
`gpus/<host>/<index>/util` (percent of time a kernel ran), `.../mem_used_mib` and `.../power_w`. On a
machine without NVML (no driver, no GPU), `nvmlInit` raises, and nothing is sampled or logged.
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import suppress
from typing import Any

import pynvml

from hpctrain.runtime.environment import launched

log = logging.getLogger("hpctrain")

GPUS_KEY = "hpctrain/gpus"  # + /<host>: the node's latest sample (json); the hosts listed under /hosts


def _nvml() -> Any | None:
    """The NVML module, initialised; None where there is no NVML (no driver: a CPU node, a laptop)."""
    try:
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None


def sample(nvml: Any) -> list[dict[str, float]]:
    """Each GPU of this node, now."""
    found = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        figures: dict[str, float] = {}
        try:
            figures["util"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            figures["mem_used_mib"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        except Exception:
            continue
        with suppress(Exception):  # not every board reports its power
            figures["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000
        found.append(figures)
    return found


class NodeSampler:
    """The sampling thread of one node (a daemon: it never keeps a process alive)."""

    def __init__(self, nvml: Any, every_s: float, store: Any) -> None:
        self.nvml = nvml
        self.every_s = every_s
        self.store = store
        self.host = launched.node_name().split(".")[0]
        self.latest: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-gpu-sampler", daemon=True)

    @classmethod
    def start(cls, every_s: float, store: Any = None) -> NodeSampler | None:
        nvml = _nvml()
        if nvml is None:
            return None
        sampler = cls(nvml, every_s, store)
        if store is not None:
            try:
                store.append(f"{GPUS_KEY}/hosts", f"{sampler.host}\n")
            except Exception:
                sampler.store = None
        sampler._thread.start()
        return sampler

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latest = sample(self.nvml)
                if self.store is not None:
                    self.store.set(f"{GPUS_KEY}/{self.host}", json.dumps(self.latest))
            except Exception as err:  # a driver that went away: stop sampling, say it once
                log.warning("GPU sampling through NVML stopped: %s", err)
                return
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()


def read(store: Any, own: NodeSampler | None) -> dict[str, float]:
    """Rank 0: every node's latest sample, as metrics."""
    nodes: dict[str, list[dict[str, float]]] = {}
    if own is not None:
        nodes[own.host] = own.latest
    if store is not None:
        try:
            if store.check([f"{GPUS_KEY}/hosts"]):
                for host in store.get(f"{GPUS_KEY}/hosts").decode().split():
                    if host not in nodes and store.check([f"{GPUS_KEY}/{host}"]):
                        nodes[host] = json.loads(store.get(f"{GPUS_KEY}/{host}"))
        except Exception:
            pass
    return {
        f"gpus/{host}/{index}/{name}": value
        for host, devices in nodes.items()
        for index, figures in enumerate(devices)
        for name, value in figures.items()
    }
