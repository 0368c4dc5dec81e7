"""The benchmarks run and report every row: scripts/dev/benchmark.py in its tiny mode, and
scripts/dev/data_benchmark.py at a tiny size. Speeds and ratios are not asserted here (the machine is
shared): the dated reports in docs/benchmarks/ come from full runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, run_script

pytestmark = pytest.mark.slow


@pytest.mark.ondemand  # a maintainer's tool, run before a dated report; the data benchmark stays in CI
def test_the_benchmark_reports_every_row(tmp_path: Path):
    out = tmp_path / "bench.json"
    result = run_script("scripts/dev/benchmark.py", "--tiny", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(out.read_text())
    assert {(r["model"], r["world_size"]) for r in report["results"]} == {("mlp", 1), ("mlp", 2)}
    for row in report["results"]:
        assert all(row[f"{v}_samples_per_s"] > 0 for v in ("raw", "lightning", "template")), row
    startup = ("help", "cfg_job", "help_composed", "cfg_job_composed", "import_hydra", "import_lightning")
    for key in (*(f"{name}_s" for name in startup), "first_step_s", "help_peak_rss_mb"):
        assert report[key] > 0, key
    costs = report["diagnostics_us_per_step"]  # the straggler clock, the NaN watch, the performance figures
    assert set(costs) == {"stragglers_us", "nan_us", "performance_us"} and all(v > 0 for v in costs.values())
    assert report["quickstart_step_ms"] > 0
    ratio = report["performance_share_of_quickstart_step"]
    assert ratio == pytest.approx(costs["performance_us"] / 1000 / report["quickstart_step_ms"], rel=0.01)
    pipeline = report["data_pipeline"] or {}
    assert not EXAMPLES or pipeline  # the row needs the CIFAR-10 datamodule of the examples
    if pipeline:
        assert pipeline["template_batches_per_s"] > 0 and pipeline["torchvision_batches_per_s"] > 0
    assert "template/lightning" in result.stdout  # the printed table


def test_the_data_benchmark_reports_every_loader_at_every_size(tmp_path: Path):
    out = tmp_path / "data.json"
    sizes = ("--sizes-mb", "1", "2", "--batches", "3", "--rounds", "1", "--batch-size", "16")
    result = run_script("scripts/dev/data_benchmark.py", *sizes, "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(out.read_text())
    assert [row["megabytes"] for row in report["sizes"]] == [1, 2]
    for row in report["sizes"]:
        assert all(row[kind]["images_per_s"] > 0 for kind in ("plain", "folder", "shards")), row
        assert row["train_images"] > 0 and row["staging"]["stage_s_per_gb"] > 0
    assert "data at scale, 2 MB" in result.stdout


@pytest.mark.ondemand  # as above; FSDP2 saves and memory are proven in tests/test_fsdp.py
def test_the_fsdp_benchmark_reports_memory_throughput_and_saves(tmp_path: Path):
    out = tmp_path / "fsdp.json"
    result = run_script("scripts/dev/fsdp_benchmark.py", "--tiny", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(out.read_text())
    assert set(report["step_s"]) == {"ddp", "fsdp", "bare"} and all(v > 0 for v in report["step_s"].values())
    # FSDP2 holds a share of the model per rank, never the whole: below DDP's, whatever the machine's speed
    assert 0 < report["state_bytes_per_rank"]["fsdp"] < report["state_bytes_per_rank"]["ddp"]
    for variant in ("ddp", "fsdp"):
        saves = report["saves"][variant]
        assert saves["sync_done_s"] > 0 and saves["async_done_s"] >= saves["async_stall_s"] > 0
        assert saves["async_stall_over_sync"] == pytest.approx(
            saves["async_stall_s"] / saves["sync_stall_s"], abs=2e-3
        )
    assert f"of sync (goal <= {1 / 8};" in result.stdout  # the ratio printed, measured in the same run
    assert all(size > 0 for size in report["saves"]["fsdp"]["bytes_per_rank"])  # every rank wrote its shard


@pytest.mark.ondemand
def test_the_lora_benchmark_reports_tokens_memory_and_the_ratio(tmp_path: Path):
    """scripts/dev/lora_benchmark.py at a tiny size: each variant's tokens/s and peak RSS, and template/bare
    computed from the same round (on demand: three processes each train a model)."""
    out = tmp_path / "lora.json"
    result = run_script("scripts/dev/lora_benchmark.py", "--tiny", "--json", str(out), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(out.read_text())
    assert set(report["tokens_per_s"]) == set(report["peak_rss_mib"]) == {"template", "bare", "qlora"}
    assert all(v > 0 for v in (*report["tokens_per_s"].values(), *report["peak_rss_mib"].values()))
    assert (
        report["template_over_bare"] > 0 and f"template/bare {report['template_over_bare']}" in result.stdout
    )
