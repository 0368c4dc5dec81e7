"""Whether the installed torch's CUDA build runs on this node's NVIDIA driver and its GPUs, read from
torch's version.py, the driver's /proc file and NVML without importing torch."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hpctrain.runtime.environment.devices import GPU
from hpctrain.runtime.environment.variables import int_or_none
from hpctrain.runtime.errors import UserError

# The oldest NVIDIA driver that runs a CUDA major release (NVIDIA's "CUDA Compatibility": minor version
# compatibility lets a build of any 13.x run on a >= 580 driver, of any 12.x on >= 525.60.13). A torch
# wheel carries its CUDA runtime; the node gives the driver.
MINIMUM_DRIVER = {13: "580", 12: "525.60.13", 11: "450.80.02"}


# The oldest GPU architecture (compute capability) a CUDA major release compiles for: CUDA 13 dropped
# Maxwell, Pascal and Volta (sm_50 to sm_72), so no torch built for it has kernels for a V100 ("no kernel
# image is available for execution on the device" at the first operation).
MINIMUM_CAPABILITY = {13: (7, 5), 12: (5, 0), 11: (3, 5)}


# PyTorch's builds of the lock's torch that `make install CUDA=<variant>` installs (from PyTorch's index)
CUDA_VARIANTS = ("cu126", "cu128", "cu130", "cpu")


DRIVER_FILE = Path("/proc/driver/nvidia/version")


def torch_build() -> tuple[str, str | None] | None:
    """The installed torch's version and the CUDA it was built for (None: a CPU build), read from its
    version.py without importing torch; None without torch."""
    try:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec else []
        text = (Path(folders[0]) / "version.py").read_text() if folders else ""
    except (ImportError, OSError, ValueError):
        return None
    version = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:['\"]([^'\"]*)['\"]|None)", text, re.M)
    if version is None or cuda is None:
        return None
    return version.group(1), cuda.group(1) or None


def driver_version(path: Path = DRIVER_FILE) -> str | None:
    """This node's NVIDIA kernel driver, e.g. 535.104.05 (None without one)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def driver_needed(cuda: str) -> str | None:
    """The oldest driver that runs CUDA `cuda` (e.g. 13.0 -> 580), None for a release not in the table."""
    major = int_or_none(cuda.split(".")[0])
    return MINIMUM_DRIVER.get(major) if major is not None else None


def _older(version: str, than: str) -> bool:
    def numbers(v: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", v))

    return numbers(version) < numbers(than)


def _cuda_starts() -> bool:
    """Whether CUDA initialises in a fresh interpreter (this one stays free of torch); True when that
    cannot be told (a compatibility package may let an older driver run a newer CUDA)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError):
        return True
    return result.returncode != 3


def check_cuda_build(
    visible: int | None,
    build: tuple[str, str | None] | None = None,
    driver: str | None = None,
    cuda_starts: Callable[[], bool] | None = None,
) -> None:
    """Refuse, in one sentence, a GPU run that CUDA cannot start: a CPU-only torch, or a torch built for a
    CUDA newer than the node's driver runs (checked by starting CUDA once, in a child process, only when
    the versions say it must fail). `build`, `driver`, `cuda_starts`: what to use instead of this node's."""
    if visible == 0:
        return
    build = build or torch_build()
    if build is None:
        return
    version, cuda = build
    if cuda is None:
        raise UserError(
            f"trainer.accelerator=gpu, but the installed torch {version} is a CPU-only build; install a CUDA "
            f"build (make install CUDA=cu126, or CUDA=cu130 where nvidia-smi shows a driver >= "
            f"{MINIMUM_DRIVER[13]}) or train on the CPU with trainer=cpu."
        )
    driver = driver or driver_version()
    needed = driver_needed(cuda)
    if driver is None or needed is None or not _older(driver, needed):
        return
    if (cuda_starts or _cuda_starts)():
        return
    if not _older(driver, MINIMUM_DRIVER[12]):
        fix = f"install torch's build for CUDA 12 (make install CUDA={CUDA_VARIANTS[0]}) or ask your site for a driver >= {needed}"
    else:
        fix = f"ask your site for a driver >= {needed} (no CUDA 12 or 13 build of torch runs on {driver})"
    raise UserError(
        f"torch {version} is built for CUDA {cuda}, which needs an NVIDIA driver >= {needed}, but this node's "
        f"driver is {driver} and CUDA does not start; {fix}."
    )


def check_gpu_architectures(gpus: Sequence[GPU] | None, build: tuple[str, str | None] | None = None) -> None:
    """Refuse, in one sentence, a GPU run on a GPU whose architecture the installed torch's CUDA cannot
    compile for (a V100, sm_70, under a CUDA 13 build). `gpus`: the GPUs this process sees (devices)."""
    build = build or torch_build()
    if not gpus or build is None or build[1] is None:
        return
    version, cuda = build
    major = int_or_none(cuda.split(".")[0])
    oldest = MINIMUM_CAPABILITY.get(major) if major is not None else None
    too_old = [gpu for gpu in gpus if oldest is not None and gpu.capability < oldest]
    if not too_old:
        return
    gpu = too_old[0]
    fix = (
        f"install torch's build for CUDA 12 (make install CUDA={CUDA_VARIANTS[0]})"
        if major is not None and major > 12
        else "install a torch built for an older CUDA"
    )
    raise UserError(
        f"GPU {gpu.index} of this node, {gpu.name}, is {gpu.arch}, but torch {version} is built for CUDA {cuda}, "
        f"which has no kernels for GPUs older than sm_{oldest[0]}{oldest[1]} (every operation would fail with "
        f"'no kernel image is available'); {fix}, or run on newer GPUs."
    )
