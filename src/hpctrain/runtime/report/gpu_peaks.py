"""hpctrain's own table of GPU peak FLOP/s, for the MFU: the GPUs of the shipped cluster presets and their
neighbours, dense (no structured-sparsity doubling), from NVIDIA's datasheets.

Lightning's table (`lightning_fabric.utilities.throughput`) misses names torch reports (`NVIDIA H200`:
its H200 rows are keyed `h200 sxm1` and hold sparse figures), reads an `NVIDIA L40S` as an L4, and lists
the Quadro RTX 8000 of many university clusters under no name. This table is consulted first; a GPU it
does not know falls back to Lightning's. `callbacks.performance.peak_flops` overrides both.

Peaks in TFLOP/s per GPU; `tf32` is the tensor-core rate of float32 matmuls where the GPU has one
(Ampere and later, with `extras.float32_matmul_precision` other than `highest`); a GPU without native
bfloat16 (Volta, Turing) has no `bf16` entry, so no MFU is claimed for an emulated precision.
"""

from __future__ import annotations

# Sources (datasheets): H200 (SXM, NVL): nvidia.com/en-us/data-center/h200; H100 (SXM, PCIe, NVL) and
# GH200: nvidia.com/en-us/data-center/h100, /grace-hopper-superchip; A100 (40/80 GB, SXM and PCIe: the
# same rates): nvidia-a100-datasheet; L40S, L40, L4, A40: their product datasheets; V100 (SXM2, PCIe,
# V100S): volta-v100-datasheet; Quadro RTX 8000/6000: quadro-rtx-8000/6000 datasheets (tensor FP16);
# T4: t4-tensor-core-datasheet.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h200 sxm": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "h200 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "h100 sxm": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "h100 pcie": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "h100 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "gh200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    "l40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0},
    "l4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "a40": {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    "v100 sxm": {"fp32": 15.7, "fp16": 125.0},
    "v100 pcie": {"fp32": 14.0, "fp16": 112.0},
    "v100s": {"fp32": 16.4, "fp16": 130.0},
    "quadro rtx 8000": {"fp32": 16.3, "fp16": 130.5},
    "quadro rtx 6000": {"fp32": 16.3, "fp16": 130.5},
    "t4": {"fp32": 8.1, "fp16": 65.0},
}


def chip(device_name: str) -> str | None:
    """The table's row for a name as `torch.cuda.get_device_name` gives it (`NVIDIA H100 80GB HBM3`,
    `Tesla V100-SXM2-32GB`, `NVIDIA L40S`), or None for a GPU the table does not know."""
    name = device_name.lower().replace("-", " ")
    words = set(name.split())
    if "gh200" in words:
        return "gh200"
    if "h200" in words:
        return "h200 nvl" if "nvl" in words else "h200 sxm"
    if "h100" in words:
        if "nvl" in words:
            return "h100 nvl"
        return "h100 pcie" if "pcie" in words or "hbm2e" in words else "h100 sxm"
    if "a100" in words or any(w.startswith("a100") for w in words):
        return "a100"
    for name_word in ("l40s", "l40", "l4", "a40", "t4"):
        if name_word in words:
            return name_word
    if "v100s" in words:
        return "v100s"
    if "v100" in words:
        return "v100 pcie" if "pcie" in words else "v100 sxm"
    if "rtx" in words and "quadro" in words:
        for model in ("8000", "6000"):
            if model in words:
                return f"quadro rtx {model}"
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of one GPU for `dtype` (`fp32`, `tf32`, `bf16`, `fp16`); `tf32` falls back to
    `fp32` on a GPU without TF32 tensor cores. None: a GPU or a precision the table has no figure for."""
    row = PEAK_TFLOPS.get(chip(device_name) or "")
    if row is None:
        return None
    value = row.get(dtype) or (row.get("fp32") if dtype == "tf32" else None)
    return value * 1e12 if value else None
