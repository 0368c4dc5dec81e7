"""`SharedRunDirCheck`: every rank of a multi-node fit writes to one shared run dir."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule, Trainer


class SharedRunDirCheck(LightningPart, lightning="pytorch_lightning.Callback"):
    """When fit starts on several nodes, check that every rank writes to the same, shared run dir: a
    node-local log dir would leave checkpoints where a requeued job, or another node, cannot find them."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            check_run_dir_is_shared(self.run_dir, trainer.num_nodes)


def check_run_dir_is_shared(run_dir: str | Path, num_nodes: int) -> None:
    """Every rank of a multi-node job must write to rank 0's run dir and see the run.yaml rank 0 wrote.

    Call it on every rank once the process group exists. The verdicts are gathered, so every rank
    stops with the same sentence (none waits in a collective for a rank that already left).
    """
    if num_nodes <= 1 or not (dist.is_available() and dist.is_initialized()):
        return
    run_dir = Path(run_dir).resolve()
    expected = [str(run_dir)]
    dist.broadcast_object_list(expected, src=0)
    where = f"rank {dist.get_rank()} on {socket.gethostname()}"
    problem = ""
    if str(run_dir) != expected[0]:
        problem = (
            f"{where} uses the run dir {run_dir} but rank 0 uses {expected[0]}; set paths.log_dir to one "
            "directory on a filesystem every node mounts (not a node-local path such as $TMPDIR)."
        )
    elif not (run_dir / "run.yaml").is_file():
        problem = (
            f"{where} cannot see {run_dir}/run.yaml, which rank 0 wrote: the run dir is not on a filesystem "
            "every node mounts; set paths.log_dir to a shared directory."
        )
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    first = next((v for v in verdicts if v), None)
    if first:
        raise UserError(first)
