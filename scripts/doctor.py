"""Before a big job: is every node ready? python scripts/doctor.py [key=value ...]

    python scripts/doctor.py                                   # this machine
    srun --nodes=2 --ntasks-per-node=1 python scripts/doctor.py paths.log_dir=/shared/logs   # an allocation

Every task checks its node, the tasks meet in a process group (nccl with GPUs, gloo without) and rank 0
prints one table: the GPUs each task sees and their model, the process group across all nodes, the
bandwidth of an all-reduce between them, the network interface each backend uses, the data dir
readable, the free space where data would be staged (the node-local scratch: $SLURM_TMPDIR, else
$TMPDIR), the log dir (run dirs) writable, and the clocks within a second of each other. The exit
status is 1 when a check fails, and the failing check and node are named. The config keys (paths.*)
are the training config's, so the same overrides give the same paths.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.environment import launched, network

CLOCK_SKEW_S = 1.0


def _writable(folder: Path) -> str | None:
    """None if a file can be created, read back and removed in `folder` (made if missing), else why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w+", dir=folder, prefix=".doctor-") as probe:
            probe.write("ok")
            probe.flush()
            probe.seek(0)
            if probe.read() != "ok":
                return f"{folder}: what was written did not read back"
    except OSError as err:
        return f"{folder}: {err.strerror or err}"
    return None


def _readable(folder: Path) -> str | None:
    if not folder.exists():
        return f"{folder} does not exist (prepare the data there: scripts/prepare_data.py)"
    try:
        next(iter(os.scandir(folder)), None)
    except OSError as err:
        return f"{folder}: {err.strerror or err}"
    return None


def node_checks(cfg: object) -> dict[str, tuple[bool, str]]:
    """What this task finds on its node: check -> (ok, what was found)."""
    import torch

    found: dict[str, tuple[bool, str]] = {}
    gpus = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    found["GPUs seen by the task"] = (True, f"{gpus} x {', '.join(names)}" if gpus else "none (CPU)")
    data_dir = Path(str(cfg.paths.data_dir))  # type: ignore[attr-defined]
    problem = _readable(data_dir)
    found["data dir readable"] = (problem is None, problem or str(data_dir))
    stage = Path(os.environ.get("SLURM_TMPDIR") or tempfile.gettempdir())
    try:
        free = shutil.disk_usage(stage).free / 2**30
        found["staging space free"] = (True, f"{free:.0f} GiB in {stage}")
    except OSError as err:
        found["staging space free"] = (False, f"{stage}: {err.strerror or err}")
    log_dir = Path(str(cfg.paths.log_dir))  # type: ignore[attr-defined]
    problem = _writable(log_dir)
    found["log dir writable"] = (problem is None, problem or str(log_dir))
    return found


def group_checks(world: int) -> tuple[dict[str, tuple[bool, str]], list[float]]:
    """Across the tasks: the all-reduce bandwidth and every task's clock (gathered by the caller)."""
    import torch
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    size = (64 if device.type == "cuda" else 16) * 2**20 // 4  # float32 elements
    tensor = torch.ones(size, device=device)
    dist.all_reduce(tensor)  # warm-up (connections, buffers)
    rounds = 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / rounds
    bus = 2 * (world - 1) / world * size * 4 / seconds / 1e9 if world > 1 else 0.0
    ok = bool(torch.all(tensor == world**6).item())  # 1 x world, then 5 more all-reduces
    measured = f"{size * 4 / 2**20:.0f} MiB in {1000 * seconds:.1f} ms, bus bandwidth {bus:.2f} GB/s ({dist.get_backend()})"
    found = {
        "all-reduce across the tasks": (
            ok,
            (measured if world > 1 else "one task: nothing to measure") if ok else "wrong sums",
        )
    }
    return found, [time.time()]


def main() -> int:
    cfg = compose("train", sys.argv[1:])
    import torch
    import torch.distributed as dist
    from lightning_fabric.plugins.environments import SLURMEnvironment

    host = launched.node_name()
    in_slurm_step = launched.launcher() == launched.SLURM
    environment = SLURMEnvironment(auto_requeue=False) if in_slurm_step else None
    world = environment.world_size() if environment else 1
    rank = environment.global_rank() if environment else 0
    results: dict[str, dict[str, tuple[bool, str]]] = {host: node_checks(cfg)}
    if environment is not None and world > 1:
        os.environ.setdefault("MASTER_ADDR", environment.main_address)
        os.environ.setdefault("MASTER_PORT", str(environment.main_port))
    else:  # one process: a group of one, on a free local port
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free.getsockname()[1]))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        # one GPU per task (--gpus-per-task=1): the task's only visible GPU, whatever its local rank
        local = environment.local_rank() if environment else 0
        torch.cuda.set_device(local if torch.cuda.device_count() > local else 0)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    except Exception as err:  # the group never forms: say so from this node
        print(
            f"error: the process group ({backend}) did not come up on {host}: {' '.join(str(err).split())[:300]}"
        )
        return 1
    found, clock = group_checks(world)
    results[host].update(found)
    results[host]["network"] = (
        True,
        network.network_summary(int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))),
    )
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, (rank, host, results[host], clock[0]))
    dist.destroy_process_group()
    if rank != 0:
        return 0
    return report(gathered)


def report(gathered: list[object]) -> int:
    """Rank 0's table: one line per check and node; failures named at the end."""
    by_host: dict[str, dict[str, tuple[bool, str]]] = {}
    clocks: dict[str, float] = {}
    for _, host, checks, clock in sorted(gathered, key=lambda g: g[0]):  # type: ignore[index]
        by_host.setdefault(host, checks)
        clocks[host] = clock
    skew = max(clocks.values()) - min(clocks.values())
    for host in by_host:
        by_host[host]["clock"] = (skew < CLOCK_SKEW_S, f"within {skew:.3f} s of the others")
    failures = []
    print(f"{'check':32} {'node':16} result")
    for check in next(iter(by_host.values())):
        for host, checks in by_host.items():
            ok, what = checks[check]
            print(f"{check:32} {host:16} {'ok  ' if ok else 'FAIL'} {what}")
            if not ok:
                failures.append(f"{check} on {host} ({what})")
    print(f"{len(gathered)} task(s) on {len(by_host)} node(s) (the process group came up across all of them)")
    if failures:
        print(f"error: {len(failures)} check(s) failed: {'; '.join(failures)}.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
