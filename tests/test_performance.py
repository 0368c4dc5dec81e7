"""Where a step's time goes (callbacks.performance): data wait, step time, samples/s, peak memory and FLOPs
per rank, NVML where there is one, traces on demand (debug=trace), and the per-rank pictures."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from hpctrain.callbacks import trace_steps as trace
from hpctrain.runtime.report import flops, gpus, performance, plots
from tests.differential.cases import user_overrides
from tests.differential.user_code import LitClassifier
from tests.helpers import ROOT, assert_ok, read_metrics, run_dirs, train

# LitClassifier: Linear(64, 32) -> ReLU -> Dropout -> Linear(32, 10). Per sample, forward 2*(64*32 + 32*10);
# backward: both gradients of the second layer, the weight gradient alone of the first (its input needs none).
LIT_CLASSIFIER_FLOPS_PER_SAMPLE = 2 * 64 * 32 * 2 + 2 * 32 * 10 * 3


def _sums(steps, wait, step, samples, peak, host):
    return {"steps": steps, "wait_s": wait, "step_s": step, "wall_s": wait + step, "samples": samples,
            "peak_mem_mib": peak, "host": host}  # fmt: skip


def test_each_rank_s_window_and_each_node_s_summary():
    before = {r: _sums(10, 1.0, 1.0, 320, 100.0, "n1") for r in range(3)}
    now = {
        0: _sums(20, 1.5, 2.5, 640, 110.0, "n1"),  # 10 steps: 0.5 s waiting, 1.5 s stepping
        1: _sums(20, 3.0, 2.0, 640, 120.0, "n1"),  # 2.0 s waiting, 1.0 s stepping
        2: _sums(20, 1.0, 3.0, 640, 90.0, "n2"),  # no wait, 2.0 s stepping
    }
    per_rank = {r: performance.figures(now[r], before[r]) for r in now}
    assert per_rank[0] == {"data_wait": 0.25, "step_ms": 150.0, "samples_per_s": 160.0, "peak_mem_mib": 110.0}
    assert per_rank[1]["data_wait"] == pytest.approx(2 / 3) and per_rank[2]["data_wait"] == 0.0
    found = performance.metrics(per_rank, {0: "n1", 1: "n1", 2: "n2"}, flops_per_sample=1e9, peak=1e12)
    assert found["perf/samples_per_s"] == pytest.approx(160 + 320 / 3 + 160)
    assert found["perf/step_ms"] == 150.0 and found["perf/peak_mem_mib"] == 120.0
    assert found["ranks/data_wait/1"] == pytest.approx(2 / 3)
    assert (found["nodes/n1/step_ms_min"], found["nodes/n1/step_ms_max"]) == (100.0, 150.0)
    assert found["nodes/n2/samples_per_s_median"] == 160.0
    assert found["perf/mfu"] == pytest.approx(found["perf/tflops_per_device"] * 1e12 / 1e12)
    assert performance.slowest_input(per_rank, 0.2) == (1, pytest.approx(2 / 3))
    assert performance.slowest_input(per_rank, 0.7) is None
    one = performance.metrics({0: per_rank[0]}, {0: "n1"}, None, None)
    assert not [k for k in one if not k.startswith("perf/")]  # one process: the job's figures only
    # tensor parallelism over pairs: each pair trains the same samples, each rank a half of their FLOPs
    paired = performance.metrics(per_rank, {0: "n1", 1: "n1", 2: "n2"}, 1e9, 1e12, tensor_parallel=2)
    assert paired["perf/samples_per_s"] == pytest.approx(found["perf/samples_per_s"] / 2)
    assert paired["perf/tflops_per_device"] == pytest.approx(found["perf/tflops_per_device"] / 2)
    assert paired["perf/mfu"] == pytest.approx(found["perf/mfu"] / 2)


def test_the_flops_of_a_step_are_counted_on_the_real_step_which_it_leaves_as_it_was():
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    module = LitClassifier()
    weights = [p.detach().clone() for p in module.parameters()]
    counter = flops.RealStepCounter()
    with pytest.warns(UserWarning):  # self.log without a trainer
        module.training_step(batch, 0).backward()
    assert counter.stop() == 32 * LIT_CLASSIFIER_FLOPS_PER_SAMPLE
    assert all(torch.equal(a, b) for a, b in zip(weights, module.parameters(), strict=True))


def test_attention_on_cpus_is_counted_as_on_gpus():
    """scaled_dot_product_attention's CPU kernel, which torch's counter has no formula for: 4 * B * H * T^2 * D
    forward (two matmuls), and five such matmuls backward, as torch counts its GPU kernels."""
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    counter = flops.RealStepCounter()
    torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    forward = 4 * 2 * 4 * 16 * 16 * 8
    assert counter.stop() == forward * 7 / 2


def test_without_nvml_nothing_is_sampled_and_nothing_fails():
    nvml = gpus._nvml()
    if nvml is None:  # this machine: no driver
        assert gpus.NodeSampler.start(0.1) is None
        assert gpus.read(None, None) == {}
        return
    sampled = gpus.sample(nvml, [0])  # a GPU machine: its first GPU, with its utilisation
    assert sampled and all(0 <= d["util"] <= 100 and d["mem_used_mib"] > 0 for d in sampled.values())


class CountingStore:
    """torch's own in-memory store, counting the requests made to it (each a round trip on TCPStore)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.HashStore()
        self.requests: list[str] = []

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.requests.append(name)
            return method(*args, **kwargs)

        return counted


class NodeNVML:
    """NVML of an 8-GPU node: GPU i at i * 10 % utilisation."""

    def nvmlDeviceGetCount(self) -> int:
        return 8

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < 8:
            raise ValueError(index)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}{handle}{handle}"

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        from types import SimpleNamespace

        return SimpleNamespace(gpu=10 * handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        from types import SimpleNamespace

        return SimpleNamespace(used=2**30)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 300_000


def test_the_gpu_sampler_samples_the_jobs_gpus_not_every_gpu_of_the_node(monkeypatch: pytest.MonkeyPatch):
    """A node shared by jobs: each job's sampler reports the GPUs it holds (CUDA_VISIBLE_DEVICES, or under
    SLURM the job's GPUs on the node, which with one GPU bound to each task are more than local rank 0
    sees), by their index on the node; a device cgroup that renumbered them leaves NVML only the job's."""
    from hpctrain.runtime.environment import devices

    uuids = devices.node_uuids(NodeNVML())
    assert devices.job_indices(uuids, {}) == list(range(8))
    assert devices.job_indices(uuids, {"CUDA_VISIBLE_DEVICES": "4,5"}) == [4, 5]
    assert devices.job_indices(uuids, {"CUDA_VISIBLE_DEVICES": "GPU-666,GPU-777"}) == [6, 7]
    per_task = {"CUDA_VISIBLE_DEVICES": "4", "SLURM_STEP_GPUS": "4,5", "SLURM_JOB_GPUS": "4,5"}
    assert devices.job_indices(uuids, per_task) == [4, 5]
    assert devices.job_indices(uuids[:2], {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_GPUS": "4,5"}) == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(key, raising=False)
    sampler = gpus.NodeSampler(NodeNVML(), 5.0, None)
    assert sampler._sampled() and sorted(sampler.latest) == ["2", "3"]
    assert gpus.read(None, sampler) == {
        f"gpus/{sampler.host}/{i}/{name}": value
        for i in (2, 3)
        for name, value in (("util", 10.0 * i), ("mem_used_mib", 1024.0), ("power_w", 300.0))
    }


def test_rank_0_reads_every_ranks_figures_in_a_few_requests_per_log_interval(monkeypatch: pytest.MonkeyPatch):
    """80 ranks on 10 nodes: at each log interval rank 0 reads every other rank's sums and every other
    node's GPU sample from the store on its training thread. Two requests per rank and two per node made
    that about 180 round trips; a handful now, and every rank and node is still there."""
    from types import SimpleNamespace

    from hpctrain.callbacks.performance_log import PerformanceLog
    from hpctrain.runtime.distributed import job_store

    store = CountingStore()
    monkeypatch.setattr(job_store, "store", lambda: store)
    world = 80
    logs = {r: PerformanceLog() for r in range(world)}
    for r, log in logs.items():
        for _ in range(50):
            log.meter.step_started()
            log.meter.step_ended(32)
        if r > 0:
            log._gathered(SimpleNamespace(global_rank=r, is_global_zero=False), "")
    for node in range(1, 10):
        other = gpus.NodeSampler(NodeNVML(), 5.0, store, indices=list(range(8)))
        other.host = f"node{node}"
        assert other._sampled()
        store.append(f"{gpus.GPUS_KEY}/hosts", f"{other.host}\n")
    logged: list[dict[str, float]] = []
    logger = SimpleNamespace(log_metrics=lambda found, step: logged.append(found))
    trainer = SimpleNamespace(
        global_rank=0, is_global_zero=True, world_size=world, loggers=[logger], global_step=50
    )
    own = gpus.NodeSampler(NodeNVML(), 5.0, None, indices=list(range(8)))
    own._sampled()
    store.requests.clear()
    logs[0]._interval(trainer)
    perf_requests = list(store.requests)
    found = gpus.read(store, own)
    assert len(perf_requests) <= 2 and len(store.requests) <= 5, store.requests
    (metrics,) = logged
    assert {int(k.rsplit("/", 1)[1]) for k in metrics if k.startswith("ranks/step_ms/")} == set(range(world))
    assert {k.split("/")[1] for k in found} == {own.host, *(f"node{n}" for n in range(1, 10))}
    assert len(found) == 10 * 8 * 3


def test_the_per_rank_view_names_the_slowest_rank(tmp_path: Path):
    with open(tmp_path / "metrics.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", "ranks/step_ms/0", "ranks/step_ms/1", "ranks/step_ms/2", "train/loss"])
        for step in range(1, 6):
            writer.writerow([step, 10.0, 10.5, 30.0 if step > 2 else 11.0, 1.0 / step])
    assert plots.slowest_rank(plots.read_series(tmp_path / "metrics.csv")).startswith("rank 2 slowest")
    assert plots.plot_ranks(tmp_path) == tmp_path / "ranks.png" and (tmp_path / "ranks.png").stat().st_size
    assert plots._panel("ranks/step_ms/0") is None and plots._panel("ranks/data_wait/3") == "data_wait"


def test_trace_ranks_are_all_one_or_a_list():
    assert trace.chosen("all", 7) and trace.chosen(3, 3) and not trace.chosen(3, 0)
    assert trace.chosen([0, 8], 8) and not trace.chosen([0, 8], 1)


def _outcome(run: Path) -> dict:
    return yaml.safe_load((run / "outcome.yaml").read_text())


@pytest.mark.slow
def test_a_slow_loader_is_reported_input_bound_and_a_fast_one_is_not(tmp_path: Path):
    """20 steps, a window every 4: the loader that sleeps 30 ms per batch warns after the first window;
    a larger model with a fast loader does not, and its peak memory is larger."""
    common = ("trainer=cpu", "trainer.max_epochs=1", "trainer.log_every_n_steps=4")
    slow = train(
        tmp_path / "slow",
        *user_overrides("LitClassifier", data="SlowLoaderData"),
        "+data.sleep_s=0.03",
        *common,
    )
    assert_ok(slow)
    assert "input-bound: this run spent" in slow.stdout and "data.num_workers" in slow.stdout
    slow_perf = _outcome(run_dirs(tmp_path / "slow")[0])["performance"]
    assert slow_perf["data_wait"] > 0.5
    assert slow_perf["flops_per_sample"] == LIT_CLASSIFIER_FLOPS_PER_SAMPLE
    assert "MFU not reported on CPUs" in slow.stdout

    wide = train(tmp_path / "wide", *user_overrides("WideClassifier"), "+model.hidden=4096", *common)
    assert_ok(wide)
    assert "input-bound" not in wide.stdout
    wide_run = run_dirs(tmp_path / "wide")[0]
    wide_perf = _outcome(wide_run)["performance"]
    assert wide_perf["data_wait"] < 0.2
    # 17 M parameters and their gradients: 130 MiB more, at least
    assert wide_perf["peak_mem_mib"] > slow_perf["peak_mem_mib"] + 100, (wide_perf, slow_perf)
    logged = [r for r in read_metrics(wide_run) if r.get("perf/step_ms")]
    assert len(logged) == 5 and all(float(r["perf/samples_per_s"]) > 0 for r in logged)


@pytest.mark.slow
def test_a_trace_per_rank_under_ddp(tmp_path: Path):
    """trainer=ddp_cpu debug=trace: each rank's figures logged by rank 0 and summarised per node, and a
    trace per rank that opens as JSON with that rank's events."""
    result = train(
        tmp_path,
        *user_overrides("LitClassifier"),
        "trainer=ddp_cpu",
        "debug=trace",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=2",
        env={"PYTHONPATH": str(ROOT)},  # the ranks Lightning starts import the user code too
    )
    assert_ok(result)
    run = run_dirs(tmp_path, task="debug")[0]
    columns = set(read_metrics(run)[0])
    for rank in (0, 1):
        assert {f"ranks/{name}/{rank}" for name in performance.FIGURES} <= columns
    assert any(c.startswith("nodes/") and c.endswith("/step_ms_max") for c in columns)
    ranks = _outcome(run)["performance"]["ranks"]
    assert sorted(ranks) == [0, 1] and all(r["steps"] == 10 for r in ranks.values())

    traces = run / "traces"
    for rank in (0, 1):
        recorded = json.loads((traces / f"rank{rank}.json").read_text())
        assert recorded["distributedInfo"]["rank"] == rank
        names = {e.get("name", "") for e in recorded["traceEvents"]}
        assert any(n.startswith("ProfilerStep#") for n in names) and "aten::addmm" in names
        assert "aten::addmm" in (traces / f"rank{rank}_top_ops.txt").read_text()
    assert "rank 0's top operations" in result.stdout


class _Event:
    """A CUDA event on a made-up device timeline: record() stamps the clock's time (milliseconds)."""

    clock = [0.0]

    def record(self) -> None:
        self.at = self.clock[0]

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: _Event) -> float:
        return later.at - self.at


def test_on_a_gpu_the_data_wait_is_the_devices_idle_time_not_the_hosts():
    """A host blocked behind a busy device (its copy queued after the last kernels) waited, but not for
    data: the device never idled. A device that idles between steps is what a slow loader looks like."""
    meter = performance.RankMeter(device="cuda:0", event=_Event)
    clock = _Event.clock
    # step 1 on the device: 0-100 ms; the host comes back at once, then blocks 90 ms behind the device
    clock[0] = 0.0
    meter.step_started()
    clock[0] = 100.0
    meter.step_ended(8)
    time.sleep(0.05)  # the host "waits" (its clock), while on the device the next step starts at once
    meter.step_started()
    clock[0] = 200.0
    meter.step_ended(8)
    busy = meter.sums()
    assert busy["wait_s"] == 0.0 and busy["step_s"] == pytest.approx(0.2) and meter.wait_s > 0.04
    clock[0] = 260.0  # the device idles 60 ms before the third step: the loader was late
    meter.step_started()
    clock[0] = 360.0
    meter.step_ended(8)
    late = performance.figures(meter.sums(), busy)
    assert late["data_wait"] == pytest.approx(60 / 160) and late["step_ms"] == pytest.approx(100.0)


def _rates(world: int, tensor_parallel: int, monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    """What `train/samples_per_s` (summed over the ranks) and the progress line say when every rank trains
    4 batches of 8 samples in 2 s: under tensor parallelism the ranks of a group read the same batch."""
    from types import SimpleNamespace

    from hpctrain.callbacks import progress_bar, throughput_log
    from hpctrain.runtime import run_state
    from hpctrain.runtime.distributed import job_store

    run_state.begin()
    if tensor_parallel > 1:
        job_store.set_data_parallel(world // tensor_parallel, 0)
    clock = [100.0]
    monkeypatch.setattr(throughput_log.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: clock[0])
    logged, lines = [], []
    module = SimpleNamespace(log=lambda name, value, **kw: logged.append(value))
    trainer = SimpleNamespace(world_size=world, is_global_zero=True, current_epoch=0, max_epochs=1)
    monkeypatch.setattr(progress_bar.log, "info", lambda message, *args: lines.append(args))
    throughput, bar = throughput_log.ThroughputLog(), progress_bar.LogProgress(every_n_s=1.0)
    monkeypatch.setattr(bar, "_format", lambda *a: "")
    throughput.on_train_epoch_start(trainer, module)
    bar._last = bar._window_start = clock[0]
    bar._total, bar._window_samples = 4, 0
    batch = (torch.zeros(8, 3), torch.zeros(8))
    for index in range(4):
        throughput.on_train_batch_start(trainer, module, batch, index)
        clock[0] += 0.5
        throughput.on_train_batch_end(trainer, module, None, batch, index)
        bar.on_train_batch_end(trainer, module, None, batch, index)
    throughput.on_train_epoch_end(trainer, module)
    run_state.begin()
    (per_rank,) = logged
    return per_rank * world, lines[-1][-1]  # sync_dist sums every rank's value; rank 0 prints the line


def test_tensor_parallel_rates_equal_data_parallel_rates_for_the_same_global_batch(monkeypatch):
    """2 processes of data parallelism and 4 in a 2 x 2 mesh train the same global batch (16) in the same
    time: train/samples_per_s and the progress line's samples/s say the same 32 samples/s for both (they
    said twice that under tensor parallelism)."""
    alone = _rates(2, 1, monkeypatch)
    split = _rates(4, 2, monkeypatch)
    assert alone == pytest.approx((32.0, 32.0))
    assert split == pytest.approx(alone)
