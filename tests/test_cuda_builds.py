"""Which CUDA build of torch a user installs, and what a run says when the node's driver cannot run it.

The lock pins PyPI's torch (CUDA 13 on Linux: NVIDIA driver >= 580, no V100); `make install CUDA=<variant>`
puts the lock's torch and torchvision built for another CUDA in its place, from PyTorch's own index. Here:
the default install is the lock's, unchanged; each variant's command pins the lock's versions; each
variant resolves on PyTorch's index (slow tier, network: skipped with the reason wherever the index cannot
be reached, CI included: a network is not a prerequisite CI can install, and CI reaches only PyPI); and the preflight names the driver a GPU run needs when CUDA cannot
start, on this CPU machine by giving it an old driver (the real CUDA start then fails here too)."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from hpctrain.runtime.environment import cuda, launch_checks
from hpctrain.runtime.errors import UserError
from tests.helpers import PYTHON, ROOT, require_programs

# the running environment's uv, else the locked .venv's (make versions tests in venvs without one)
UV = next((str(p) for p in (Path(PYTHON).with_name("uv"), ROOT / ".venv" / "bin" / "uv") if p.exists()), "uv")
PYTORCH_INDEX = "download.pytorch.org"


def _locked(name: str) -> str:
    """The version uv.lock pins for `name`."""
    found = re.search(rf'^name = "{name}"\nversion = "([^"]+)"', (ROOT / "uv.lock").read_text(), re.M)
    assert found, name
    return found.group(1)


# ------------------------------------------------------------------------------ the preflight's sentence


def test_the_installed_torch_build_is_read_without_importing_it():
    import torch

    assert cuda.torch_build() == (torch.__version__, torch.version.cuda)


def test_the_driver_version_is_read_from_the_kernel_modules_line(tmp_path: Path):
    proprietary = tmp_path / "proprietary"
    proprietary.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
        "GCC version:  gcc version 9.4.0 (Ubuntu 9.4.0-1ubuntu1~20.04.2)\n"
    )
    open_module = tmp_path / "open"
    open_module.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
        "(dvs-builder@U16-I1-N07-12-3)  Sun Jul 27 07:09:40 UTC 2025\n"
    )
    assert cuda.driver_version(proprietary) == "535.104.05"
    assert cuda.driver_version(open_module) == "580.65.06"
    assert cuda.driver_version(tmp_path / "absent") is None
    assert [cuda.driver_needed(c) for c in ("13.0", "12.6", "12.8", "11.8", "14.0")] == [
        "580",
        "525.60.13",
        "525.60.13",
        "450.80.02",
        None,
    ]


def _never(*_: object) -> bool:
    raise AssertionError("CUDA was started although the versions say it runs")


@pytest.mark.parametrize(
    ("driver", "fix"),
    [
        ("535.104.05", "install torch's build for CUDA 12 (make install CUDA=cu126) or ask your site"),
        (
            "470.82.01",
            "ask your site for a driver >= 580 (no CUDA 12 or 13 build of torch runs on 470.82.01)",
        ),
    ],
)
def test_a_driver_too_old_for_torchs_cuda_is_named_with_the_driver_needed(driver: str, fix: str):
    with pytest.raises(UserError) as refused:
        cuda.check_cuda_build(1, ("2.14.1+cu130", "13.0"), driver, cuda_starts=lambda: False)
    sentence = str(refused.value)
    assert sentence.startswith(
        f"torch 2.14.1+cu130 is built for CUDA 13.0, which needs an NVIDIA driver >= 580, but this node's "
        f"driver is {driver} and CUDA does not start; "
    )
    assert fix in sentence and sentence.endswith(".") and ". " not in sentence  # one sentence


def test_nothing_is_said_where_cuda_runs():
    # a driver new enough: CUDA is not even started to ask
    cuda.check_cuda_build(1, ("2.14.1+cu130", "13.0"), "580.65.06", cuda_starts=_never)
    cuda.check_cuda_build(1, ("2.14.1+cu126", "12.6"), "535.104.05", cuda_starts=_never)
    # an older driver that runs it all the same (NVIDIA's forward-compatibility package in a container)
    cuda.check_cuda_build(1, ("2.14.1+cu130", "13.0"), "535.104.05", cuda_starts=lambda: True)
    # no driver here, or no GPU visible: the GPU checks before this one speak
    cuda.check_cuda_build(None, ("2.14.1+cu130", "13.0"), None, cuda_starts=_never)
    cuda.check_cuda_build(0, ("2.14.1+cpu", None), None, cuda_starts=_never)


def test_a_cpu_only_torch_on_a_gpu_run_is_refused_in_one_sentence():
    with pytest.raises(UserError, match=r"^trainer\.accelerator=gpu, but the installed torch 2\.14\.1\+cpu"):
        cuda.check_cuda_build(2, ("2.14.1+cpu", None), "580.65.06", cuda_starts=_never)


@pytest.mark.slow
class FakeNVML:
    """NVML as a node of `gpus` answers it: (name, uuid, compute capability) per index."""

    def __init__(self, gpus: list[tuple[str, str, tuple[int, int]]]) -> None:
        self.gpus = gpus

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.gpus[handle][1]

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self.gpus[handle][0].encode()

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return self.gpus[handle][2]


MIXED_NODE = FakeNVML(
    [("NVIDIA A100-SXM4-80GB", "GPU-aaaa-0000", (8, 0)), ("Tesla V100-SXM2-32GB", "GPU-bbbb-1111", (7, 0))]
)


def test_the_gpus_a_process_sees_are_read_without_torch_from_cuda_visible_devices():
    from hpctrain.runtime.environment import devices

    def seen(visible: str | None) -> list[int]:
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        return [gpu.index for gpu in devices.visible_gpus(env, MIXED_NODE) or []]

    assert seen(None) == [0, 1] and seen("1") == [1] and seen("1,0") == [1, 0]
    assert seen("GPU-bbbb") == [1] and seen("0,GPU-bbbb-1111") == [0, 1]  # UUIDs, a prefix enough
    assert seen("") == [] and seen("-1") == [] and seen("0,7,1") == [0]  # CUDA stops at the first miss
    (v100,) = devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, MIXED_NODE) or []
    assert (v100.name, v100.arch) == ("Tesla V100-SXM2-32GB", "sm_70")


def test_a_gpu_older_than_torchs_cuda_compiles_for_is_refused_in_one_sentence():
    """A V100 (sm_70) under a CUDA 13 build of torch (the lock's, on PyPI) would pass every check and die
    at the first operation with "no kernel image is available"; under CUDA 12 it runs."""
    from hpctrain.runtime.environment import devices

    v100 = devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, MIXED_NODE)
    with pytest.raises(UserError) as refused:
        cuda.check_gpu_architectures(v100, ("2.14.1+cu130", "13.0"))
    assert str(refused.value) == (
        "GPU 1 of this node, Tesla V100-SXM2-32GB, is sm_70, but torch 2.14.1+cu130 is built for CUDA 13.0, "
        "which has no kernels for GPUs older than sm_75 (every operation would fail with 'no kernel image is "
        "available'); install torch's build for CUDA 12 (make install CUDA=cu126), or run on newer GPUs."
    )
    cuda.check_gpu_architectures(v100, ("2.14.1+cu126", "12.6"))
    cuda.check_gpu_architectures(
        devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, MIXED_NODE), ("2.14.1", "13.0")
    )
    cuda.check_gpu_architectures(None, ("2.14.1+cu130", "13.0"))  # no NVML: nothing to say


@pytest.mark.slow  # the preflight starts CUDA in a child interpreter that imports torch
def test_the_preflight_of_a_gpu_run_names_the_driver_when_cuda_fails_to_start(
    monkeypatch: pytest.MonkeyPatch,
):
    """The preflight as a GPU run on Slurm meets it, on a node whose driver (given here) is older than the
    installed torch's CUDA needs: CUDA really fails to start (this machine has no GPU at all), in a
    child process, and the run ends before anything is built with the sentence naming both."""
    import torch

    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    needed = cuda.driver_needed(torch.version.cuda or "13.0")
    if torch.version.cuda is None or needed is None:
        pytest.skip(f"the installed torch {torch.__version__} is not a CUDA 11-13 build")
    monkeypatch.setattr(cuda, "driver_version", lambda path=None: "470.82.01")
    with pytest.raises(UserError) as refused:
        launch_checks.preflight(1, 1, "gpu", env=env)
    assert f"which needs an NVIDIA driver >= {needed}, but this node's driver is 470.82.01" in str(
        refused.value
    )


# ------------------------------------------------------------------------------------ the install commands


def _make_install(venv: Path, *variables: str) -> list[str]:
    """The commands `make install` would run for a venv at `venv` (make -n: nothing runs)."""
    require_programs("make", install="apt-get install make")
    result = subprocess.run(
        ["make", "-n", "install", f"VENV={venv}", *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def _uv_commands(lines: list[str], verb: str) -> list[list[str]]:
    return [shlex.split(line.split("uv ", 1)[1]) for line in lines if f"/bin/uv {verb} " in line]


def test_the_default_install_is_the_locks_build_unchanged(tmp_path: Path):
    lines = _make_install(tmp_path / "venv")
    (sync,) = _uv_commands(lines, "sync")
    assert sync == [
        *["sync", "--quiet", "--frozen", "--inexact"],
        *["--extra", "dev", "--extra", "loggers", "--extra", "export", "--extra", "docs", "--extra", "llm"],
        "--compile-bytecode",
    ]
    assert _uv_commands(lines, "pip") == []
    result = subprocess.run([UV, "lock", "--check", "--offline"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # uv.lock is pyproject.toml's, as make install uses it


@pytest.mark.parametrize("variant", cuda.CUDA_VARIANTS)
def test_a_variants_install_puts_the_locks_torch_for_that_cuda_in_place(tmp_path: Path, variant: str):
    lines = _make_install(tmp_path / "venv", f"CUDA={variant}")
    (sync,) = _uv_commands(lines, "sync")
    skipped = {sync[i + 1] for i, word in enumerate(sync) if word == "--no-install-package"}
    assert {"torch", "torchvision", "nvidia-nccl-cu13", "nvidia-cudnn-cu13", "cuda-toolkit"} <= skipped
    assert "nvidia-ml-py" not in skipped  # hpctrain's own (GPU figures), not torch's
    (install,) = _uv_commands(lines, "pip")
    assert install[install.index("--torch-backend") + 1] == variant
    assert install[-2:] == [f"torch=={_locked('torch')}", f"torchvision=={_locked('torchvision')}"]
    # the choice stays for the next make install / make train; CUDA=lock goes back, reinstalling torch
    (tmp_path / "venv").mkdir(exist_ok=True)
    (tmp_path / "venv" / ".cuda").write_text(f"{variant}\n")
    assert _uv_commands(_make_install(tmp_path / "venv"), "pip") == [install]
    (back,) = _uv_commands(_make_install(tmp_path / "venv", "CUDA=lock"), "sync")
    assert back[-4:] == ["--reinstall-package", "torch", "--reinstall-package", "torchvision"]


def _reachable(host: str) -> str | None:
    """None if `host` answers on port 443 here, else why not."""
    try:
        socket.create_connection((host, 443), timeout=10).close()
    except OSError as err:
        return f"{host} (PyTorch's package index) cannot be reached from here ({err.strerror or err})"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("variant", cuda.CUDA_VARIANTS)
def test_each_variant_of_the_locked_torch_resolves_on_pytorchs_index(tmp_path: Path, variant: str):
    """What `make install CUDA=<variant>` asks uv for, resolved against PyTorch's index for Linux x86_64:
    PyTorch publishes the lock's torch and torchvision for that CUDA (a variant it has dropped fails)."""
    why = _reachable(PYTORCH_INDEX)
    if why is not None:
        pytest.skip(why)
    torch, vision = _locked("torch"), _locked("torchvision")
    result = subprocess.run(
        [
            *[UV, "pip", "compile", "--torch-backend", variant, "--python-version", "3.11"],
            *["--python-platform", "x86_64-manylinux_2_28", "--no-header", "--no-annotate", "-"],
        ],
        input=f"torch=={torch}\ntorchvision=={vision}\n",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    pins = set(result.stdout.split())
    assert {f"torch=={torch}+{variant}", f"torchvision=={vision}+{variant}"} <= pins, result.stdout
