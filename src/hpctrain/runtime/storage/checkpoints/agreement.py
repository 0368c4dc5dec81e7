"""One rank chooses the start point, every rank uses it.

`start_point` looks at folders: this run dir's checkpoints on a restart, every earlier run's for
`ckpt_path=last`. Every rank of a job looking for itself could see different things: rank 0 tidies what an
interrupted save left at the same moment, another run writes its last.ckpt between two ranks' looks, and a
node's filesystem cache can show a folder as it was seconds ago. Ranks that resume different checkpoints
train different steps and hang in their first collective, or worse, do not. No process group exists yet,
so the choice travels through the run dir, which every rank of a job shares:

- global rank 0 chooses, then records its choice for this attempt in `<run dir>/.start_point.json`
  (written whole: a reader never sees half of it), keyed by the attempt (`attempt`), so a record of an
  earlier attempt is never taken for this one's;
- every other rank started with it (an srun step's tasks, torchrun's workers) waits for that record and
  uses it, whatever it would have chosen itself;
- the ranks Lightning's own launcher starts later (local ranks > 0 of a plain `python src/train.py`) find
  rank 0's choice in their environment, which they inherit.

Only where a choice is made from folders (a restart, `ckpt_path=last`) do the ranks wait; a first attempt
starts fresh or from the named file on every rank alike, and leaves no record. No torch here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from hpctrain.runtime import confined
from hpctrain.runtime.environment import launched
from hpctrain.runtime.environment.variables import variables
from hpctrain.runtime.errors import UserError

RECORD = ".start_point.json"
INHERITED = "HPCTRAIN_START_POINT"  # rank 0's choice, for the local ranks Lightning starts after it chose
POLL_S = 0.2


def attempt(env: Mapping[str, str] | None = None) -> str:
    """This attempt of the job, as every one of its ranks names it: the run id and the restart counts."""
    return (
        f"{launched.run_id(env)} restart {launched.restart_count(env)}.{launched.torchrun_restart_count(env)}"
    )


def needed(given: str | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether the ranks started together must take rank 0's choice: they are several, and the choice is
    made from folders (a restart, or `ckpt_path=last`). Decided from the environment and the command line
    alone, so that every rank, rank 0 included, decides alike."""
    if (
        launched.launcher(env) not in (launched.SLURM, launched.TORCHRUN)
        or launched.processes_started(env) < 2
    ):
        return False
    restarted = launched.restart_count(env) > 0 or launched.torchrun_restart_count(env) > 0
    return restarted or given == "last"


def tell(
    run_dir: Path, checkpoint: Path | None, reason: str, shared: bool, env: Mapping[str, str] | None = None
) -> None:
    """Rank 0's choice, for the other ranks: the record (when they wait for one) and, in this process's
    environment, for the local ranks Lightning's launcher will start."""
    choice = {
        "attempt": attempt(env),
        "run_dir": str(run_dir),
        "checkpoint": str(checkpoint or ""),
        "reason": reason,
    }
    if env is None:
        os.environ[INHERITED] = json.dumps(choice)
    if shared:
        partial = run_dir / f"{RECORD}.{os.getpid()}.partial"
        partial.write_text(json.dumps(choice))
        os.replace(partial, run_dir / RECORD)


def rank_zeros_choice(
    run_dir: Path, shared: bool, env: Mapping[str, str] | None, wait_s: float
) -> tuple[str, str] | None:
    """(checkpoint or "", reason) as rank 0 chose them for this attempt; None where this rank chooses for
    itself (a first attempt's start, the same on every rank). Waits up to `wait_s` for the record."""
    inherited = variables(env).get(INHERITED)
    if launched.launcher(env) == launched.CHILD and inherited:
        choice = json.loads(inherited)
        if choice.get("run_dir") == str(run_dir):
            return choice["checkpoint"], choice["reason"]
    if not shared:
        return None
    me, record = attempt(env), run_dir / RECORD
    deadline = time.monotonic() + wait_s
    while True:
        try:
            choice = confined.read_json(record, "record", folder=run_dir)
        except (OSError, ValueError, UserError):
            choice = {}
        if choice.get("attempt") == me:
            return choice["checkpoint"], choice["reason"]
        if time.monotonic() >= deadline:
            rank, host = launched.global_rank(env), socket.gethostname()
            raise UserError(
                f"rank {rank} on {host} waited {wait_s:.0f} s for rank 0 to "
                f"record which checkpoint this attempt starts from ({record}); the run dir must be on a "
                "filesystem every node mounts (set paths.log_dir to a shared directory), and rank 0 may "
                "have stopped before it chose (see its output)."
            )
        time.sleep(POLL_S)
