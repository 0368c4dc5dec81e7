"""Where is every rank of a run right now? python scripts/stacks.py <run dir | SLURM job id> [--wait 3]

Sends the run's `diagnostics.stacks_signal` (SIGURG) to every rank: to the run's processes on this
machine, or, for a SLURM job, with `scancel --signal` to its tasks on every node. Each rank appends its
Python stacks (all threads) to <run dir>/stacks/rank<N>.txt; this prints where each rank is, ranks in
the same place together, e.g.

    ranks 0-2, 4-7: all_reduce in training_step at model.py:41; rank 3: on_train_batch_start at user.py:12

(the innermost call, and the innermost frame outside torch, Lightning and the standard library).
Works while the job hangs: the stacks are written by a C signal handler. No torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import yaml

from hpctrain.runtime.distributed import stacks


def fail(sentence: str) -> NoReturn:
    print(f"error: {sentence}", file=sys.stderr)
    sys.exit(2)


def find_run_dir(target: str, log_dir: Path) -> tuple[Path, str | None]:
    """The run dir and, for a SLURM job, its id."""
    path = Path(target)
    if path.is_dir():
        job = path.name.removeprefix("slurm-") if path.name.startswith("slurm-") else None
        return path, job
    found = sorted(log_dir.glob(f"*/runs/slurm-{target}")) + sorted(
        log_dir.glob(f"*/multiruns/slurm-{target}/*")
    )
    found = [d for d in found if (d / stacks.STACKS_DIR).is_dir()]
    if not found:
        fail(
            f"{target} is neither a run dir nor a SLURM job with a run under {log_dir}/*/runs/; "
            "pass the run dir (or --log-dir)."
        )
    return found[-1], target


def stacks_signal(run_dir: Path) -> signal.Signals:
    config = run_dir / "config.yaml"
    name = None
    if config.is_file():
        name = ((yaml.safe_load(config.read_text()) or {}).get("diagnostics") or {}).get("stacks_signal")
    return signal.Signals[name or "SIGURG"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a run dir, or the SLURM job id of a run")
    parser.add_argument("--wait", type=float, default=3.0, help="seconds to wait for the ranks' answers")
    parser.add_argument("--log-dir", type=Path, default=Path("logs"), help="where runs are (paths.log_dir)")
    args = parser.parse_args()
    run_dir, job = find_run_dir(args.target, args.log_dir)
    ranks = stacks.known_ranks(run_dir)
    if not ranks:
        fail(
            f"{run_dir} has no {stacks.STACKS_DIR}/rank<N>{stacks.PID_SUFFIX}: its ranks never started building the run."
        )
    sig = stacks_signal(run_dir)
    files = {rank: stacks.rank_file(run_dir, rank) for rank in ranks}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sizes = {}
    for rank, path in files.items():
        with open(path, "a") as file:
            file.write(f"\n{stacks.HEADER} {stamp}: asked by scripts/stacks.py\n")
        sizes[rank] = path.stat().st_size
    host = socket.gethostname()
    if job is not None:  # every task of the job's steps, on every node (the batch shell is left alone)
        sent = subprocess.run(
            ["scancel", f"--signal={sig.name.removeprefix('SIG')}", job], capture_output=True, text=True
        )
        if sent.returncode != 0:
            fail(f"scancel --signal={sig.name} {job} failed: {(sent.stderr or sent.stdout).strip()}")
    else:
        away = sorted(r for r, (_, h) in ranks.items() if h != host)
        if away:
            print(
                f"{stacks.ranges(away)} run on other machines; pass the SLURM job id to reach them",
                file=sys.stderr,
            )
        for pid, where in ranks.values():
            if where == host:
                with contextlib.suppress(ProcessLookupError):  # a rank that has ended
                    os.kill(pid, sig)
    time.sleep(args.wait)
    places = {}
    for rank, path in files.items():
        text = stacks.latest_dump(path, since=sizes[rank])
        frames = stacks.main_thread_frames(text)
        places[rank] = stacks.where(frames) if frames else "did not answer"
    print(f"stacks of {len(files)} rank(s) at {stamp}, in {run_dir / stacks.STACKS_DIR}/rank<N>.txt:")
    print(stacks.summary(places))
    return 0


if __name__ == "__main__":
    sys.exit(main())
