"""Print the torchrun command each node runs for a multi-node job without SLURM (or under SLURM, with
one `srun torchrun` task per node). Every count comes from one place, so none can disagree.

    python scripts/torchrun_command.py --nodes 2 --gpus-per-node 8 --master-addr 10.0.0.1 -- experiment=mnist_cnn
    python scripts/torchrun_command.py --nodes 2 --cpu --processes-per-node 1 --master-addr 127.0.0.1 -- experiment=quickstart
    python scripts/torchrun_command.py --nodes 4 --gpus-per-node 8 --srun -- experiment=mnist_cnn   # inside sbatch

Static rendezvous (node ranks given) unless --c10d: then every node runs the same command and torchrun
assigns the ranks. The run id (--rdzv-id) names the run dir, logs/train/runs/torchrun-<id>, on every node.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node = processes per node")
    parser.add_argument("--cpu", action="store_true", help="CPU nodes: trainer=ddp_cpu (gloo)")
    parser.add_argument("--processes-per-node", type=int, default=1, help="with --cpu: processes per node")
    parser.add_argument("--master-addr", default="$MASTER_ADDR", help="address of node 0, reachable by all")
    parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rank 0's port (default: 29500; with --srun, $MASTER_PORT, which slurm/job_env.sh derives from the job id)",
    )
    parser.add_argument("--c10d", action="store_true", help="c10d rendezvous: the same command on every node")
    parser.add_argument(
        "--srun", action="store_true", help="the `srun torchrun` form for a SLURM batch script"
    )
    parser.add_argument("--run-id", default=None, help="run id (default: the current time)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for src/train.py (after --)")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1 or args.processes_per_node < 1:
        parser.error("--nodes, --gpus-per-node and --processes-per-node must be at least 1")
    clashing = [o for o in args.overrides if o.startswith(("trainer.num_nodes=", "trainer.devices="))]
    if clashing:
        parser.error(
            f"{clashing[0]} is set from --nodes / --gpus-per-node (or --processes-per-node); drop it"
        )
    return args


def _launcher(words: list[str]) -> str:
    """torchrun and its flags for a shell line: a `$VARIABLE` in a flag stays for the node's shell to expand
    (double quotes; shlex would single-quote it into a literal). The training overrides are quoted with
    shlex.join, as Hydra's `${...}` interpolations must reach Hydra unexpanded."""
    return " ".join(f'"{w}"' if "$" in w else shlex.quote(w) for w in words)


def commands(args: argparse.Namespace) -> list[str]:
    per_node = args.processes_per_node if args.cpu else args.gpus_per_node
    run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S")
    trainer = (
        []
        if any(o.startswith("trainer=") for o in args.overrides)
        else ["trainer=ddp_cpu" if args.cpu else "trainer=ddp"]
    )
    train = [
        "src/train.py",
        *trainer,
        f"trainer.num_nodes={args.nodes}",
        f"trainer.devices={per_node}",
        *args.overrides,
    ]
    sizes = [f"--nnodes={args.nodes}", f"--nproc-per-node={per_node}"]
    common = [*sizes, f"--rdzv-id={run_id}"]
    endpoint = f"{args.master_addr}:{args.master_port or 29500}"
    if args.srun:
        # the run id is the SLURM job id, so a requeued job finds its run dir; the port is the job's own
        # (slurm/job_env.sh: from the job id), so two jobs sharing a first node do not meet on a fixed one;
        # the shell expands the names
        port = args.master_port or "$MASTER_PORT"
        rendezvous = [
            "--rdzv-backend=c10d",
            "--rdzv-id=$SLURM_JOB_ID",
            f"--rdzv-endpoint=$MASTER_ADDR:{port}",
        ]
        line = f"{_launcher(['torchrun', *sizes, *rendezvous])} {shlex.join(train)}"
        return [
            "source slurm/job_env.sh  # slurm/site.sh, then MASTER_ADDR (the first node) and MASTER_PORT (from the job id)",
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {line}",
        ]
    if args.c10d:
        launcher = ["torchrun", *common, "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
        return [f"{_launcher(launcher)} {shlex.join(train)}"]
    return [
        f"{_launcher(['torchrun', *common, f'--node-rank={rank}', f'--master-addr={args.master_addr}', f'--master-port={args.master_port or 29500}'])}"
        f" {shlex.join(train)}"
        for rank in range(args.nodes)
    ]


def main(argv: list[str]) -> int:
    args = parse(argv)
    lines = commands(args)
    if args.srun:
        print("# in the sbatch script (one task per node: #SBATCH --ntasks-per-node=1):")
    elif args.c10d:
        print("# on every node:")
    for number, line in enumerate(lines):
        if not args.srun and not args.c10d:
            print(f"# on node {number}:")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
