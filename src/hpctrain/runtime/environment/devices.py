"""The GPUs this process sees, as the driver's management library (NVML) describes them, without torch:
which of the node's GPUs CUDA_VISIBLE_DEVICES names, and each one's name and compute capability.

CUDA_VISIBLE_DEVICES names GPUs by index or by UUID (`GPU-...`, `MIG-...`, a prefix is enough), and CUDA
stops at the first entry that names none; an index is NVML's when both count in PCI bus order (CUDA's
default orders the fastest first, which differs only on a node of mixed GPUs without
CUDA_DEVICE_ORDER=PCI_BUS_ID). Where a device cgroup (Slurm's ConstrainDevices) hides the job's other
GPUs, NVML and CUDA both number the ones left from 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpctrain.runtime.environment.variables import variables


@dataclass(frozen=True)
class GPU:
    index: int  # NVML's index on this node
    name: str
    capability: tuple[int, int]  # CUDA compute capability, (7, 0) for sm_70

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def visible_indices(uuids: Sequence[str], env: Mapping[str, str] | None = None) -> list[int]:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES names, `uuids` being NVML's UUID of each index of the
    node (all of them when it is unset)."""
    visible = variables(env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(len(uuids)))
    found: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < len(uuids):
            index = int(entry)
        else:
            matches = [i for i, uuid in enumerate(uuids) if entry and uuid.startswith(entry)]
            if len(matches) != 1:
                break  # as CUDA does: an entry that names no GPU (-1, a typo) hides it and all after it
            index = matches[0]
        if index in found:
            break
        found.append(index)
    return found


def job_indices(uuids: Sequence[str], env: Mapping[str, str] | None = None) -> list[int]:
    """NVML indices of the GPUs the job holds on this node, `uuids` being NVML's UUID of each index: under
    SLURM the step's or job's GPUs (SLURM_STEP_GPUS, SLURM_JOB_GPUS: the node's numbering, NVML's, so
    with one GPU bound to each task the node's whole share of the job; where a device cgroup left NVML
    fewer GPUs than those numbers reach, the ones it shows, which are the job's); else the GPUs
    CUDA_VISIBLE_DEVICES names."""
    env = variables(env)
    held = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    if held:
        indices = [int(i) for i in held.split(",") if i.strip().isdigit()]
        return indices if indices and max(indices) < len(uuids) else list(range(len(uuids)))
    return visible_indices(uuids, env)


def nvml() -> Any | None:
    """NVML, initialised; None where there is none (no driver: a CPU node, a laptop)."""
    import pynvml  # only where a GPU run is checked: off `--help`'s and every CPU run's path

    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None
    return pynvml


def node_uuids(library: Any) -> list[str]:
    """NVML's UUID of each GPU index of this node ('' for one it cannot read)."""
    found = []
    for index in range(library.nvmlDeviceGetCount()):
        uuid = ""
        with contextlib.suppress(Exception):
            raw = library.nvmlDeviceGetUUID(library.nvmlDeviceGetHandleByIndex(index))
            uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
        found.append(uuid)
    return found


def visible_gpus(env: Mapping[str, str] | None = None, library: Any | None = None) -> list[GPU] | None:
    """The GPUs this process sees, with their names and compute capabilities; None without NVML."""
    library = library or nvml()
    if library is None:
        return None
    try:
        found = []
        for index in visible_indices(node_uuids(library), env):
            handle = library.nvmlDeviceGetHandleByIndex(index)
            name = library.nvmlDeviceGetName(handle)
            major, minor = library.nvmlDeviceGetCudaComputeCapability(handle)
            found.append(GPU(index, name.decode() if isinstance(name, bytes) else str(name), (major, minor)))
        return found
    except Exception:  # a driver that answers part of it: nothing to check against
        return None
