"""A cluster preset as a Slurm request, in one place: scripts/submit.py (its jobs, arrays and packs) and the
SLURM launcher ask sbatch for the same job; no preset is `Cluster()`'s defaults, which the #SBATCH lines of
slurm/*.sbatch hold too (tests/test_preset_requests.py). No torch here."""

from __future__ import annotations

import os
import re

from hpctrain.runtime.config.settings import Cluster

PER_NODE = ("ntasks-per-node", "gres", "mem")  # a node's counts, each the flag's last number: gpu:a100:4, 2G


def slurm_request(preset: Cluster | None, nodes: int, tasks_per_node: int, gpus: bool) -> dict[str, str]:
    """sbatch's flags (`--<flag>=<value>`) for `nodes` x `tasks_per_node` tasks, one GPU each when `gpus`, on
    the cluster of `preset` (None: `Cluster()`'s defaults); what the preset leaves open is left out."""
    preset = preset or Cluster()
    gb = preset.mem_per_task_gb * tasks_per_node  # 0: all of each node's memory, as sbatch's --mem=0
    flags = {
        "nodes": nodes,
        "ntasks-per-node": tasks_per_node,
        "gres": f"gpu:{f'{preset.gpu_type}:' if preset.gpu_type else ''}{tasks_per_node}" if gpus else "none",
        "cpus-per-task": preset.cpus_per_task,
        "mem": 0 if gb == 0 else f"{int(gb)}G" if gb == int(gb) else f"{round(gb * 1024)}M",  # per node
        "time": preset.time_min,
        "partition": preset.partition,
        "account": preset.account,
        "qos": preset.qos,
    }
    return {flag: str(value) for flag, value in flags.items() if value is not None}


def packed_request(request: dict[str, str], points: int) -> dict[str, str]:
    """`points` jobs of `request` side by side on one node: its tasks, GPUs and memory that many times."""
    times = re.compile(r"\d+(?!.*\d)")  # the last number (--mem=0, all of the node's, stays 0)
    return {
        flag: times.sub(lambda count: str(int(count[0]) * points), value) if flag in PER_NODE else value
        for flag, value in request.items()
    }


def as_run(point: list[str], nodes: int | str, tasks_per_node: int | str) -> list[str]:
    """A point's overrides as slurm/train.sbatch completes them (trainer=ddp unless it chooses one, the counts,
    the collective timeout, then its own), so that a config composed from them signs as the job's will."""
    trainer = [] if any(o.startswith("trainer=") for o in point) else ["trainer=ddp"]
    counts = [f"trainer.num_nodes={nodes}", f"trainer.devices={tasks_per_node}"]
    return [*trainer, *counts, f"dist.timeout_min={os.environ.get('COLLECTIVE_TIMEOUT_MIN', '30')}", *point]
