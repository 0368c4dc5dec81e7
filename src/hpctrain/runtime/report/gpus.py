"""GPU utilisation, memory and power from NVML (`nvidia-ml-py`), sampled by local rank 0 of each node.

A thread samples the job's GPUs of its node (`devices.job_indices`: not the other jobs' GPUs of a shared
node) every `callbacks.performance.gpu_every_s` seconds and puts the latest figures in the job's store;
global rank 0 logs every node's at the log interval as `gpus/<host>/<index>/util` (percent of time a
kernel ran), `.../mem_used_mib` and `.../power_w`, `<index>` being the GPU's on its node (NVML's,
nvidia-smi's). Rank 0 reads them off the store in three requests, whatever the number of nodes. On a
machine without NVML (no driver, no GPU), `nvmlInit` raises, and nothing is sampled or logged.
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import suppress
from typing import Any

from hpctrain.runtime.environment import devices, launched

log = logging.getLogger("hpctrain")

GPUS_KEY = "hpctrain/gpus"  # + /<host>: the node's latest sample (json); the hosts listed under /hosts


def _nvml() -> Any | None:
    """The NVML module, initialised; None where there is no NVML (no driver: a CPU node, a laptop)."""
    return devices.nvml()


def sample(nvml: Any, indices: list[int]) -> dict[str, dict[str, float]]:
    """Each of these GPUs of this node (NVML's indices), now."""
    found = {}
    for index in indices:
        figures: dict[str, float] = {}
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            figures["util"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            figures["mem_used_mib"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        except Exception:
            continue
        with suppress(Exception):  # not every board reports its power
            figures["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000
        found[str(index)] = figures
    return found


class NodeSampler:
    """The sampling thread of one node (a daemon: it never keeps a process alive)."""

    def __init__(self, nvml: Any, every_s: float, store: Any, indices: list[int] | None = None) -> None:
        self.nvml = nvml
        self.every_s = every_s
        self.store = store
        self.host = launched.node_name().split(".")[0]
        self.indices = devices.job_indices(devices.node_uuids(nvml)) if indices is None else indices
        self.latest: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-gpu-sampler", daemon=True)

    @classmethod
    def start(cls, every_s: float, store: Any = None) -> NodeSampler | None:
        nvml = _nvml()
        if nvml is None:
            return None
        sampler = cls(nvml, every_s, store)
        if not sampler._sampled():
            return None
        if store is not None:
            try:  # listed once its first sample is in: rank 0 reads every listed host in one request
                store.append(f"{GPUS_KEY}/hosts", f"{sampler.host}\n")
            except Exception:
                sampler.store = None
        sampler._thread.start()
        return sampler

    def _sampled(self) -> bool:
        try:
            self.latest = sample(self.nvml, self.indices)
            if self.store is not None:
                self.store.set(f"{GPUS_KEY}/{self.host}", json.dumps(self.latest))
        except Exception as err:  # a driver that went away: stop sampling, say it once
            log.warning("GPU sampling through NVML stopped: %s", err)
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s) and self._sampled():
            pass

    def stop(self) -> None:
        self._stop.set()


def read(store: Any, own: NodeSampler | None) -> dict[str, float]:
    """Rank 0: every node's latest sample, as metrics, in at most three requests to the store (the list
    of hosts, whether it exists, and every other host's sample at once)."""
    nodes: dict[str, dict[str, dict[str, float]]] = {}
    if own is not None:
        nodes[own.host] = own.latest
    if store is not None:
        try:
            if store.check([f"{GPUS_KEY}/hosts"]):
                hosts = [
                    h
                    for h in dict.fromkeys(store.get(f"{GPUS_KEY}/hosts").decode().split())
                    if h not in nodes
                ]
                if hosts:  # each sampled once before it was listed: multi_get never waits
                    for host, raw in zip(
                        hosts, store.multi_get([f"{GPUS_KEY}/{h}" for h in hosts]), strict=True
                    ):
                        nodes[host] = json.loads(raw)
        except Exception:
            pass
    return {
        f"gpus/{host}/{index}/{name}": value
        for host, sampled in nodes.items()
        for index, figures in sampled.items()
        for name, value in figures.items()
    }
