"""Submit slurm/train.sbatch with every count derived from one place, so none can disagree.

    python scripts/submit.py --nodes 10 --gpus-per-node 8 -- experiment=mnist_cnn model.optimizer.lr=0.01
    python scripts/submit.py --nodes 2 --cpu --dry-run -- experiment=quickstart

GPU jobs get --ntasks-per-node = --gres=gpu:N = --gpus-per-node (one task per GPU); CPU jobs get
--gres=none, --processes-per-node tasks per node and trainer=ddp_cpu. The sbatch command is printed
before it runs (--dry-run prints only). Everything after `--` is passed to src/train.py as Hydra
overrides, as separate arguments: nothing goes through a shell.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH_FILE = ROOT / "slurm" / "train.sbatch"
# Counts that the submit flags set; passing them as overrides too could only create a mismatch.
DERIVED = ("trainer.num_nodes=", "trainer.devices=")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node = tasks per node (default 8)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="CPU-only cluster: no GPUs, trainer=ddp_cpu (gloo)"
    )
    parser.add_argument(
        "--processes-per-node", type=int, default=1, help="with --cpu: processes per node (default 1)"
    )
    parser.add_argument("--cpus-per-task", type=int, help="CPU cores per task (default: the sbatch file's)")
    parser.add_argument("--time", help="time limit, e.g. 04:00:00")
    parser.add_argument("--mem", help="memory per node, e.g. 200G (default: the sbatch file's)")
    parser.add_argument("--partition", help="partition (queue)")
    parser.add_argument("--account", help="account to charge")
    parser.add_argument("--qos", help="quality of service")
    parser.add_argument("--job-name", help="job name (default: train)")
    parser.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="any other sbatch flag, repeatable: --sbatch-arg=--constraint=a100",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch command, do not submit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for src/train.py (after --)")
    args = parser.parse_args(argv)
    for name in ("nodes", "gpus_per_node", "processes_per_node", "cpus_per_task"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be at least 1")
    clashing = [o for o in args.overrides if o.startswith(DERIVED)]
    if clashing:
        parser.error(
            f"{clashing[0]} is set from --nodes / --gpus-per-node (or --processes-per-node); drop it"
        )
    return args


def sbatch_command(args: argparse.Namespace) -> list[str]:
    per_node = args.processes_per_node if args.cpu else args.gpus_per_node
    command = [
        "sbatch",
        f"--nodes={args.nodes}",
        f"--ntasks-per-node={per_node}",
        "--gres=none" if args.cpu else f"--gres=gpu:{per_node}",
        f"--chdir={ROOT}",
        f"--output={ROOT / 'slurm' / 'logs'}/%x-%j.out",
    ]
    optional = {
        "--cpus-per-task": args.cpus_per_task,
        "--time": args.time,
        "--mem": args.mem,
        "--partition": args.partition,
        "--account": args.account,
        "--qos": args.qos,
        "--job-name": args.job_name,
    }
    command += [f"{flag}={value}" for flag, value in optional.items() if value is not None]
    command += args.sbatch_arg
    command.append(str(SBATCH_FILE))
    overrides = list(args.overrides)
    if args.cpu and not any(o.startswith("trainer=") for o in overrides):
        overrides.insert(0, "trainer=ddp_cpu")
    return command + overrides


def main(argv: list[str]) -> int:
    args = parse(argv)
    command = sbatch_command(args)
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    if shutil.which("sbatch") is None:
        print(
            "error: sbatch is not on PATH; run this on a SLURM login node (or use --dry-run).",
            file=sys.stderr,
        )
        return 2
    (ROOT / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
