"""The MFU's peak FLOP/s on the GPUs of the shipped cluster presets: hpctrain's own table (NVIDIA's dense
datasheet figures) before Lightning's, which misses the H200 and reads an L40S as an L4. On CPU: the
device name and capability that CUDA would report are given to the code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpctrain.runtime.report import flops, gpu_peaks

# (torch.cuda.get_device_name as the GPUs report it, the table's row)
NAMES = [
    ("NVIDIA H200", "h200 sxm"),
    ("NVIDIA H200 NVL", "h200 nvl"),
    ("NVIDIA H100 80GB HBM3", "h100 sxm"),
    ("NVIDIA H100 PCIe", "h100 pcie"),
    ("NVIDIA H100 NVL", "h100 nvl"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L40", "l40"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A40", "a40"),
    ("Tesla V100-SXM2-32GB", "v100 sxm"),
    ("Tesla V100-PCIE-16GB", "v100 pcie"),
    ("Tesla V100S-PCIE-32GB", "v100s"),
    ("Quadro RTX 8000", "quadro rtx 8000"),
    ("Tesla T4", "t4"),
    ("NVIDIA GeForce RTX 4090", None),
]


@pytest.mark.parametrize(("name", "row"), NAMES)
def test_each_gpu_name_finds_its_row(name: str, row: str | None):
    assert gpu_peaks.chip(name) == row


def test_the_table_holds_dense_datasheet_figures():
    assert gpu_peaks.peak_flops("NVIDIA H200", "bf16") == 989.5e12  # 1,979 with sparsity
    assert gpu_peaks.peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert gpu_peaks.peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert gpu_peaks.peak_flops("NVIDIA L40S", "fp16") == 362.05e12
    assert gpu_peaks.peak_flops("Quadro RTX 8000", "fp16") == 130.5e12
    # no TF32 tensor cores: float32 matmuls run at the float32 rate; no native bf16: no figure at all
    assert gpu_peaks.peak_flops("Tesla V100-SXM2-32GB", "tf32") == 15.7e12
    assert gpu_peaks.peak_flops("Tesla V100-SXM2-32GB", "bf16") is None
    assert gpu_peaks.peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    for row, peaks in gpu_peaks.PEAK_TFLOPS.items():
        assert set(peaks) <= {"fp32", "tf32", "bf16", "fp16"}, row
        assert peaks.get("bf16", 0) <= peaks.get("fp16", 0) or "fp16" not in peaks, row


def _trainer(precision: str) -> SimpleNamespace:
    import torch

    return SimpleNamespace(precision=precision, strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))


@pytest.mark.parametrize(
    ("name", "capability", "precision", "expected"),
    [
        ("NVIDIA H200", (9, 0), "bf16-mixed", 989.5e12),  # Lightning's table has no "nvidia h200"
        ("NVIDIA L40S", (8, 9), "16-mixed", 362.05e12),  # Lightning's reads it as an L4 (121e12)
        ("NVIDIA A100-SXM4-40GB", (8, 0), "32-true", 156e12),  # TF32 at the template's "high"
        ("Quadro RTX 8000", (7, 5), "32-true", 16.3e12),
        ("NVIDIA GeForce RTX 3090", (8, 6), "bf16-mixed", 35.6e12),  # not ours: Lightning's figure
    ],
)
def test_the_mfu_peak_comes_from_hpctrains_table_then_lightnings(
    monkeypatch: pytest.MonkeyPatch, name, capability, precision, expected
):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert flops.peak_flops(_trainer(precision), None) == pytest.approx(expected)
    assert flops.peak_flops(_trainer(precision), 1e15) == 1e15  # callbacks.performance.peak_flops


def test_a_gpu_in_neither_table_logs_no_mfu_and_says_how_to_set_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Imaginary X1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    with caplog.at_level("WARNING", logger="hpctrain"):
        assert flops.peak_flops(_trainer("bf16-mixed"), None) is None
    assert "callbacks.performance.peak_flops=" in caplog.text and "NVIDIA Imaginary X1" in caplog.text
