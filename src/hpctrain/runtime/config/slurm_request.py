"""A cluster preset as a Slurm request, in one place: scripts/submit.py (slurm/train.sbatch, the job array,
packs) and the SLURM launcher (hydra/launcher=slurm) ask sbatch for the same job. Without a preset the
values are `Cluster()`'s defaults, which the `#SBATCH` lines of slurm/*.sbatch hold too
(tests/test_preset_requests.py keeps the three equal). No torch here.
"""

from __future__ import annotations

import re

from hpctrain.runtime.config.settings import Cluster
from hpctrain.runtime.errors import UserError

MEMORY = re.compile(r"(\d+)([KMGT]?)B?")  # sbatch --mem: a whole number, MB unless K, M, G or T follows


def slurm_request(preset: Cluster | None, nodes: int, tasks_per_node: int, gpus: bool) -> dict[str, str]:
    """sbatch's flags (`--<flag>=<value>`) for `nodes` x `tasks_per_node` tasks, one GPU each when `gpus`, on
    the cluster of `preset` (None: `Cluster()`'s defaults); what the preset leaves open is left out."""
    preset = preset or Cluster()
    gb = None if preset.mem_per_task_gb is None else preset.mem_per_task_gb * tasks_per_node
    flags = {
        "nodes": nodes,
        "ntasks-per-node": tasks_per_node,
        "gres": f"gpu:{f'{preset.gpu_type}:' if preset.gpu_type else ''}{tasks_per_node}" if gpus else "none",
        "cpus-per-task": preset.cpus_per_task,
        "mem": 0 if gb is None else f"{int(gb)}G" if gb == int(gb) else f"{round(gb * 1024)}M",  # per node
        "time": preset.time_min,
        "partition": preset.partition,
        "account": preset.account,
        "qos": preset.qos,
    }
    return {flag: str(value) for flag, value in flags.items() if value is not None}


def packed_request(request: dict[str, str], points: int) -> dict[str, str]:
    """`points` jobs of `request` side by side on one node: its tasks, GPUs and memory that many times."""
    node_mb = megabytes(request.get("mem", "0"))  # 0: all of the node's, for all the points
    return {
        **request,
        "ntasks-per-node": str(int(request["ntasks-per-node"]) * points),
        "gres": re.sub(r"\d+$", lambda count: str(int(count[0]) * points), request["gres"]),
        **({"mem": f"{node_mb * points}M"} if node_mb and points > 1 else {}),
    }


def megabytes(value: str) -> int:
    """sbatch --mem: a number of MB, or with a K/M/G/T suffix; 0 means all of a node's memory."""
    found = MEMORY.fullmatch(str(value).upper())
    if found is None:  # from a preset or the sbatch file: the command line's is checked by argparse
        raise UserError(
            f"--mem={value} is not a memory size sbatch takes (a whole number with an optional K, M, G or T "
            "suffix, e.g. 1536M or 2G); fix it in the cluster preset or slurm/train.sbatch."
        )
    number, unit = found.groups()
    return int(int(number) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}[unit])
