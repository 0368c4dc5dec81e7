"""Submit slurm/train.sbatch with every count derived from one place, so none can disagree.

    python scripts/submit.py --nodes 10 --gpus-per-node 8 -- experiment=mnist_cnn model.optimizer.lr=0.01
    python scripts/submit.py --nodes 2 --cpu --dry-run -- experiment=quickstart
    python scripts/submit.py --sweep --parallel 2 --nodes 2 -- model.optimizer.lr=0.1,0.01 data.batch_size=64,128
    python scripts/submit.py --sweep --pack 4 --gpus-per-node 1 -- model.optimizer.lr=0.1,0.01 seed=1,2,3,4

GPU jobs get --ntasks-per-node = --gres=gpu:N = --gpus-per-node (one task per GPU); CPU jobs get
--gres=none, --processes-per-node tasks per node and trainer=ddp_cpu. The sbatch command is printed
before it runs (--dry-run prints only). --pack N runs N points of a sweep side by side in each job, on
one node, each with these counts (slurm/pack.sbatch). Everything after `--` is passed to src/train.py as Hydra
overrides, as separate arguments: nothing goes through a shell.

The job runs from a snapshot of the code taken now (hpctrain.runtime.snapshot: tracked files as they
are, untracked ones git does not ignore, conf/local/), in logs/snapshots/<digest>/, so a requeued
attempt runs the same code as the first however the working copy changes meanwhile; --no-snapshot runs
the working copy instead. Logs, data and the venv stay in the project.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this code: the project, or a snapshot of it
sys.path.insert(0, str(ROOT / "src"))

from hpctrain.runtime import snapshot  # noqa: E402
from hpctrain.runtime.config.compose import group_options  # noqa: E402
from hpctrain.runtime.config.settings import Cluster  # noqa: E402
from hpctrain.runtime.config.slurm_request import as_run, packed_request, slurm_request  # noqa: E402
from hpctrain.runtime.environment import launched  # noqa: E402
from hpctrain.runtime.errors import UserError  # noqa: E402

PROJECT = launched.project_root(
    ROOT
)  # where logs/, data/ and .venv are (HPCTRAIN_PROJECT_ROOT in a snapshot)
SBATCH_FILE = ROOT / "slurm" / "train.sbatch"
SWEEP_FILE = ROOT / "slurm" / "sweep.sbatch"
PACK_FILE = ROOT / "slurm" / "pack.sbatch"
# Counts that the submit flags set; passing them as overrides too could only create a mismatch.
DERIVED = ("trainer.num_nodes=", "trainer.devices=")
GIVEN = ("cpus-per-task", "mem", "time", "partition", "account", "qos")  # flags that win over the preset


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--cluster",
        help="a cluster preset (conf/cluster/ or hpctrain's: partition, account, GPUs, CPUs and memory, time, setup lines); "
        "flags given here win over it (without one, over the sbatch file's #SBATCH lines: the same defaults)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, help=f"GPUs (= tasks) per node (default {Cluster().gpus_per_node})"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="CPU-only cluster: no GPUs, trainer=ddp_cpu (gloo)"
    )
    parser.add_argument("--processes-per-node", type=int, help="with --cpu: processes per node (default 1)")
    parser.add_argument("--cpus-per-task", type=int, help="CPU cores per task (default: the preset's)")
    parser.add_argument("--time", help="time limit, e.g. 04:00:00")
    parser.add_argument("--mem", type=memory, help="memory per node, e.g. 200G (default: the preset's)")
    parser.add_argument("--partition", help="partition (queue)")
    parser.add_argument("--account", help="account to charge")
    parser.add_argument("--qos", help="quality of service")
    names = [file_defaults(path).get("job-name") for path in (SBATCH_FILE, SWEEP_FILE, PACK_FILE)]
    parser.add_argument(  # the sbatch files' own names: the project's, so squeue tells projects apart
        "--job-name",
        help=f"job name (default: the sbatch file's, {names[0]}; {names[1]} with --sweep, {names[2]} with --pack)",
    )
    parser.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="any other sbatch flag, repeatable: --sbatch-arg=--constraint=a100",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the overrides are a Hydra sweep grid (lr=0.1,0.01 ...): one array task per point (slurm/sweep.sbatch)",
    )
    parser.add_argument("--parallel", type=int, help="with --sweep: array tasks that may run at once")
    parser.add_argument(
        "--pack",
        type=int,
        metavar="N",
        help="with --sweep: N points side by side in each job, on one node, each with the counts above "
        "(its own GPUs, or CPUs with --cpu), requeued together (slurm/pack.sbatch)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch command, do not submit")
    parser.add_argument(
        "--no-snapshot",
        action="store_true",
        help="run the working copy's code in every attempt instead of a snapshot taken now (logs/snapshots/)",
    )
    remote = parser.add_argument_group("a cluster behind SSH (the SLURM guide: From your laptop)")
    remote.add_argument(
        "--remote", metavar="[USER@]HOST[:DIR]", help="submit on this login node, into the project DIR there"
    )
    remote.add_argument("--remote-python", help="the remote project's python (default: DIR/.venv/bin/python)")
    remote.add_argument("--ssh-config", help="an ssh config file (default: yours, ~/.ssh/config)")
    remote.add_argument("--status", metavar="JOB", help="with --remote: the job's state")
    remote.add_argument("--logs", metavar="JOB", help="with --remote: the tail of the job's SLURM output")
    remote.add_argument("--fetch", metavar="JOB", help="with --remote: its run dir into logs/remote/<host>/")
    remote.add_argument("--with-checkpoints", action="store_true", help="with --fetch: the checkpoints too")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for src/train.py (after --)")
    args = parser.parse_args(argv)
    for name in ("nodes", "gpus_per_node", "processes_per_node", "cpus_per_task", "parallel", "pack"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be at least 1")
    clashing = [o for o in args.overrides if o.startswith(DERIVED)]
    if clashing:
        parser.error(
            f"{clashing[0]} is set from --nodes / --gpus-per-node (or --processes-per-node); drop it"
        )
    if args.pack is not None and not args.sweep:
        parser.error(
            f"--pack {args.pack} runs several points of a sweep in one job, but this is not a sweep; add --sweep "
            "and a grid (model.optimizer.lr=0.1,0.01 ...), or drop --pack"
        )
    if args.pack is not None and args.nodes > 1:
        parser.error(
            f"--pack {args.pack} puts the points of a job side by side on one node, but --nodes {args.nodes} asks "
            f"for {args.nodes} nodes per point; pack points that fit one node (--nodes 1), or drop --pack "
            "(one array task per point)"
        )
    args.resume_dir = None
    if args.sweep and "skip_completed=true" in [o.lower() for o in args.overrides]:
        given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("hydra.sweep.dir=")]
        if not given:
            parser.error(
                "skip_completed=true re-runs an earlier sweep: name its dir with hydra.sweep.dir=<multirun dir>"
            )
        args.resume_dir = Path(given[-1]).expanduser().resolve()
    args.preset = None
    if args.cluster:  # the job gets cluster=<name> too: its config records it (and `offline`, `scratch_dir`)
        presets = group_options("cluster")  # the project's conf/cluster/ and hpctrain's
        if args.cluster not in presets:
            parser.error(
                f"--cluster {args.cluster}: there is no conf/cluster/{args.cluster}.yaml; the presets are "
                f"{', '.join(presets)}"
            )
        args.preset = Cluster.load(presets[args.cluster])  # checked: a typo is one sentence naming the file
        args.overrides = [f"cluster={args.cluster}", *args.overrides]
    preset = args.preset or Cluster()  # no preset: Cluster()'s defaults, the sbatch files' #SBATCH lines
    args.cpu = args.cpu or preset.gpus_per_node == 0  # a GPU preset's tasks_per_node are its GPUs'
    cpu_tasks = args.processes_per_node or (preset.tasks_per_node if preset.gpus_per_node == 0 else 1)
    args.tasks_per_node = cpu_tasks if args.cpu else args.gpus_per_node or preset.gpus_per_node
    return args


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The jobs of the Hydra sweep grid in `overrides`, in Hydra's order."""
    from hpctrain.runtime.sweeps.grid import expand

    return expand(overrides)


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides the job gets from here (trainer=ddp_cpu on a CPU cluster, the user's after it)."""
    overrides = list(args.overrides)
    if args.cpu and not any(o.startswith("trainer=") for o in overrides):
        overrides.insert(0, "trainer=ddp_cpu")
    return overrides


def missing_points(args: argparse.Namespace) -> list[int]:
    """The job numbers to submit: every point of the grid, or with skip_completed=true and
    hydra.sweep.dir=<an earlier sweep's dir>, those that did not complete there with the same config."""
    points = sweep_points(job_overrides(args))
    if not args.resume_dir:
        return list(range(len(points)))
    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.storage.records import completed_with, config_signature

    todo = [
        number
        for number, point in enumerate(points)
        if completed_with(
            args.resume_dir / str(number),
            config_signature(compose("train", as_run(point, args.nodes, args.tasks_per_node))),
        )
        is None
    ]
    print(
        f"skip_completed: {len(points) - len(todo)} of {len(points)} point(s) completed in {args.resume_dir} "
        f"with the same config; submitting {len(todo)}",
        file=sys.stderr,
    )
    return todo


def requested_resources(args: argparse.Namespace) -> dict[str, str]:
    """What this submission asks sbatch for: the preset's request, the flags given here winning (--mem is a
    point's, as the preset's); without a preset, the counts and the flags given, the rest the file's."""
    given = {flag: str(v) for flag in GIVEN if (v := getattr(args, flag.replace("-", "_"))) is not None}
    request = slurm_request(args.preset, args.nodes, args.tasks_per_node, gpus=not args.cpu) | given
    flags = packed_request(request, args.pack or 1)  # a pack: that many points' tasks, GPUs and memory
    counts = ("nodes", "ntasks-per-node", "gres", *given)
    return flags if args.preset else {flag: value for flag, value in flags.items() if flag in counts}


def sbatch_command(args: argparse.Namespace) -> list[str]:
    command = [
        "sbatch",
        *(f"--{flag}={value}" for flag, value in requested_resources(args).items()),
        f"--chdir={ROOT}",
        f"--output={PROJECT / 'slurm' / 'logs'}/%x-{'%A_%a' if args.sweep else '%j'}.out",
    ]
    packed: list[str] = []  # slurm/pack.sbatch's own arguments
    if args.sweep:
        limit = f"%{args.parallel}" if args.parallel else ""
        todo = missing_points(args)
        if args.pack:
            packs = -(-len(todo) // args.pack)
            command.append(f"--array={f'0-{packs - 1}' if todo else ''}{limit}")
            packed = [
                f"--pack={args.pack}",
                *([f"--points={','.join(map(str, todo))}"] if args.resume_dir else []),
            ]
        else:
            command.append(
                f"--array={','.join(map(str, todo)) if args.resume_dir else f'0-{todo[-1]}'}{limit}"
            )
    command += [f"--job-name={args.job_name}"] if args.job_name else []
    command += args.sbatch_arg
    command.append(str(PACK_FILE if args.pack else SWEEP_FILE if args.sweep else SBATCH_FILE))
    return command + packed + job_overrides(args)


# ------------------------------------------------------------------ requests that can never start


def file_defaults(path: Path = SBATCH_FILE) -> dict[str, str]:
    """The `#SBATCH --flag=value` lines of the sbatch file (what a flag not given on the command line is)."""
    found = re.findall(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", path.read_text(), flags=re.MULTILINE)
    return {flag: value for flag, value in found}


def requested(command: list[str]) -> dict[str, str]:
    """The flags sbatch will see: the batch file's, overridden by the command line's."""
    flags = file_defaults(next(Path(arg) for arg in command if arg.endswith(".sbatch") and arg[0] != "-"))
    for arg in command:
        if arg.startswith("--") and "=" in arg:
            flag, value = arg[2:].split("=", 1)
            flags[flag] = value
    return flags


MEMORY = re.compile(r"(\d+)([KMGT]?)B?")


def memory(value: str) -> str:
    """--mem as sbatch takes it (argparse's check): a whole number, with an optional K, M, G or T suffix."""
    if MEMORY.fullmatch(str(value).upper()) is None:
        raise argparse.ArgumentTypeError(
            f"{value} is not a memory size sbatch takes: a whole number with an optional K, M, G or T suffix, "
            "e.g. --mem 1536M or --mem 2G"
        )
    return value


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


def gpus(gres: str) -> int:
    """GPUs in a gres string such as gpu:8, gpu:a100:4 or gpu:4(S:0-1); 0 for none or (null)."""
    return sum(int(m) for m in re.findall(r"gpu(?::[\w-]+)?:(\d+)", gres or ""))


def partition_nodes(partition: str | None) -> tuple[str, list[dict[str, int]]]:
    """The partition's name (the default one if None) and, per node, its CPUs, memory (MB) and GPUs."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        said = " ".join((getattr(err, "stderr", None) or str(err)).split())[:200]
        raise UserError(
            f"sinfo, which says what the partition's nodes hold, failed ({said or type(err).__name__}); check that "
            "SLURM answers on this machine (sinfo), or see the command without submitting it: --dry-run."
        ) from err
    nodes: dict[str, tuple[str, dict[str, int]]] = {}
    for line in out.splitlines():
        name, part, cpus, memory, gres = line.strip().split("|")
        default = part.endswith("*")
        part = part.rstrip("*")
        if (partition is None and default) or part == partition:
            nodes[name] = (part, {"cpus": int(cpus), "memory": int(memory), "gpus": gpus(gres)})
    chosen = next(iter(nodes.values()))[0] if nodes else (partition or "default")
    return chosen, [info for _, info in nodes.values()]


def never_fits(flags: dict[str, str], partition: str, nodes: list[dict[str, int]]) -> str | None:
    """The sentence saying why this request can never start in the partition (it would pend forever)."""
    if not nodes:
        return (
            f"partition {partition} has no nodes (sinfo shows none); pass --partition=<one that sinfo lists>."
        )
    wanted_nodes = int(flags.get("nodes", "1"))
    per_node = int(flags.get("ntasks-per-node", "1"))
    cores = per_node * int(flags.get("cpus-per-task", "1"))
    memory = megabytes(flags.get("mem", "0"))
    gpus_per_node = gpus(flags.get("gres", ""))
    if wanted_nodes > len(nodes):
        return f"--nodes={wanted_nodes} but partition {partition} has {len(nodes)} node(s); pass --nodes={len(nodes)} or fewer."
    most = {
        key: sorted((n[key] for n in nodes), reverse=True)[wanted_nodes - 1]
        for key in ("cpus", "memory", "gpus")
    }
    if gpus_per_node > most["gpus"]:
        have = f"at most {most['gpus']} GPU(s) per node" if most["gpus"] else "no GPUs"
        fix = (
            "pass --cpu for a CPU-only cluster"
            if not most["gpus"]
            else f"pass --gpus-per-node={most['gpus']} or fewer"
        )
        return (
            f"--gres={flags['gres']} but partition {partition} has {have}; {fix} (or choose a GPU partition)."
        )
    if cores > most["cpus"]:
        fewer = max(1, most["cpus"] // per_node)
        return (
            f"--cpus-per-task={flags.get('cpus-per-task', '1')} x --ntasks-per-node={per_node} needs {cores} cores on "
            f"each of {wanted_nodes} node(s), but partition {partition} has nodes of at most {most['cpus']}; "
            f"pass --cpus-per-task={fewer} or fewer."
        )
    if memory > most["memory"]:
        return (
            f"--mem={flags['mem']} per node, but partition {partition}'s nodes have at most {most['memory']} MB; "
            f"pass --mem={most['memory']}M or less (--mem=0 takes all of each node's memory)."
        )
    return None


def pack_never_fits(
    pack: int, flags: dict[str, str], partition: str, nodes: list[dict[str, int]]
) -> str | None:
    """With --pack: the sentence saying that the pack's points together fit no node of the partition,
    though one point would (each point alone is never_fits' question)."""
    if pack <= 1 or not nodes:
        return None
    cores = int(flags.get("ntasks-per-node", "1")) * int(flags.get("cpus-per-task", "1"))
    wanted = {
        "gpus": (gpus(flags.get("gres", "")), "GPU(s)"),
        "cpus": (cores, "cores"),
        "memory": (megabytes(flags.get("mem", "0")), "MB of memory"),
    }
    for key, (total, unit) in wanted.items():
        most, point = max(n[key] for n in nodes), total // pack
        if point and point <= most < total:
            return (
                f"--pack {pack} puts {pack} points of {point} {unit} each on one node, but partition {partition}'s "
                f"nodes have at most {most}; pass --pack {most // point} or fewer."
            )
    return None


def from_snapshot(command: list[str], code: Path) -> list[str]:
    """The same sbatch command, run from the snapshot `code`: its batch script, its directory, and
    HPCTRAIN_PROJECT_ROOT naming the project (whose logs/, data/ and .venv the job uses)."""
    moved = []
    for arg in command:
        if arg == f"--chdir={ROOT}":
            arg = f"--chdir={code}"
        elif arg in (str(SBATCH_FILE), str(SWEEP_FILE), str(PACK_FILE)):
            arg = str(code / Path(arg).relative_to(ROOT))
        moved.append(arg)
    moved.insert(1, f"--export=ALL,HPCTRAIN_PROJECT_ROOT={PROJECT}")
    return moved


def take_snapshot() -> snapshot.Snapshot | None:
    try:
        code = snapshot.take(ROOT)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    changes = f", uncommitted changes {code.diff_sha256[:12]}" if code.diff_sha256 else ""
    print(f"code snapshot: {code.path} (commit {(code.commit or 'none')[:12]}{changes})", flush=True)
    return code


REMOTE_ONLY = ("--remote", "--remote-python", "--ssh-config")


def local_arguments(argv: list[str]) -> list[str]:
    """submit.py's arguments for the remote side: without those that say how to reach it."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in REMOTE_ONLY:
            skip = True
            continue
        if arg.startswith(tuple(f"{flag}=" for flag in REMOTE_ONLY)):
            continue
        kept.append(arg)
    return kept


def remote_main(args: argparse.Namespace, argv: list[str]) -> int:
    from hpctrain.runtime.remote import Remote

    try:
        remote = Remote.parse(args.remote, args.remote_python, args.ssh_config, ROOT.name)
        if args.status:
            print(remote.status(args.status))
        elif args.logs:
            print(remote.logs(args.logs), end="")
        elif args.fetch:
            host = remote.host.split("@")[-1]
            where = remote.fetch(args.fetch, PROJECT / "logs" / "remote" / host, args.with_checkpoints)
            print(f"run dir of job {args.fetch}: {where}")
        else:
            code = take_snapshot()
            if code is None:
                return 2
            job = remote.submit(code, local_arguments(argv))
            print(
                f"job {job} on {remote.host}; follow it with --remote {args.remote} --status {job} (or --logs, --fetch)"
            )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def command_has_empty_array(command: list[str]) -> bool:
    return any(arg.startswith("--array=") and arg[len("--array=") :].split("%")[0] == "" for arg in command)


def main(argv: list[str]) -> int:
    """Submit (see the module docstring); a mistake is one sentence and exit status 2."""
    try:
        return submit(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def submit(argv: list[str]) -> int:
    args = parse(argv)
    if args.remote:
        return remote_main(args, argv)
    if args.status or args.logs or args.fetch:
        print(
            "error: --status, --logs and --fetch ask a remote cluster: add --remote [user@]host[:dir].",
            file=sys.stderr,
        )
        return 2
    command = sbatch_command(args)
    if command_has_empty_array(command):
        print("nothing to submit: every point of the sweep completed there.", flush=True)
        return 0
    if args.dry_run:
        print(shlex.join(command), flush=True)
        if not args.no_snapshot:
            print(
                "(submitted for real, the job runs from a snapshot of the code in logs/snapshots/)",
                file=sys.stderr,
            )
        return 0
    if shutil.which("sbatch") is None:
        print(
            "error: sbatch is not on PATH; run this on a SLURM login node (or use --dry-run).",
            file=sys.stderr,
        )
        return 2
    flags = requested(command)
    partition, nodes = partition_nodes(flags.get("partition"))
    problem = pack_never_fits(args.pack or 1, flags, partition, nodes) or never_fits(flags, partition, nodes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    (PROJECT / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
    if snapshot.manifest(ROOT) is not None:  # this code is a snapshot already (sent by --remote)
        command = from_snapshot(command, ROOT)
    elif not args.no_snapshot:  # every attempt, requeued ones too, runs the code as it is now
        code = take_snapshot()
        if code is None:
            return 2
        command = from_snapshot(command, code.path)
    print(shlex.join(command), flush=True)
    # the preset's setup lines and an earlier sweep's dir reach the job through its environment
    env = dict(os.environ)
    if args.preset and args.preset.setup:
        env["HPCTRAIN_CLUSTER_SETUP"] = "\n".join(args.preset.setup)  # run by slurm/job_env.sh
    if args.resume_dir is not None:
        env["HPCTRAIN_SWEEP_DIR"] = str(args.resume_dir)  # read by slurm/sweep.sbatch
    return subprocess.run(command, check=False, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
