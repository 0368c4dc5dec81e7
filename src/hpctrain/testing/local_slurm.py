"""A real two-node Slurm cluster on this machine: slurmctld plus two slurmd, in one directory.

The tests start it through the `slurm_cluster` fixture (hpctrain.testing.plugin); users can start it to try the
sbatch files before going to a real cluster:

    python -m hpctrain.testing.local_slurm start /tmp/slurm     # prints the SLURM_CONF to export
    python -m hpctrain.testing.local_slurm stop /tmp/slurm

Needs Debian's slurm-wlm and munge (`apt-get install slurm-wlm munge`) and root, because the
daemons run as root and the node names are added to /etc/hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "srun")
NODE_NAMES = ("node1", "node2")
# the job states `wait` ends at
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# Held while a cluster picks its ports and until its daemons listen on them: two clusters started at once
# (one per pytest-xdist worker) would otherwise pick the same free ports, and one's daemons would fail to
# bind while its clients talked to the other's.
STARTING_LOCK = Path(tempfile.gettempdir()) / "hpctrain-local-slurm.lock"


class ClusterUnavailable(RuntimeError):
    """The machine lacks what a local Slurm cluster needs."""


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS if not shutil.which(name) and not Path("/usr/sbin", name).exists()]


def _free_ports(count: int) -> list[int]:
    """`count` consecutive free TCP ports (slurm.conf takes a port range for the nodes)."""
    for start in range(17000, 30000, 7):
        ports = list(range(start, start + count))
        if all(_port_is_free(port) for port in ports):
            return ports
    raise ClusterUnavailable("no free TCP ports for the Slurm daemons")


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def ensure_munge() -> None:
    """Start munged unless a working one already answers."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run([_sbin("mungekey"), "-c"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", _sbin("munged")], check=True)
    for _ in range(50):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise ClusterUnavailable("munged started but `munge -n | unmunge` does not succeed")


def ensure_node_names_resolve() -> None:
    """Lightning takes MASTER_ADDR from the first node name, so node1 must resolve."""
    unresolved = []
    for name in NODE_NAMES:
        try:
            socket.gethostbyname(name)
        except OSError:
            unresolved.append(name)
    if not unresolved:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"add '127.0.0.1 {' '.join(NODE_NAMES)}' to /etc/hosts")
    with open("/etc/hosts", "a") as hosts:
        hosts.write(f"127.0.0.1 {' '.join(NODE_NAMES)}\n")


class LocalSlurmCluster:
    """slurmctld and one slurmd per node name, all state and logs under `root`."""

    def __init__(
        self, root: Path, cpus_per_node: int = 16, memory_mb: int = 8000, first_job_id: int = 1
    ) -> None:
        """`cpus_per_node` may exceed the machine's cores (SlurmdParameters=config_overrides), so the
        sbatch templates' GPU-cluster-sized --cpus-per-task fit on a laptop-sized test machine.
        `first_job_id`: where its job ids start. A job's MASTER_PORT comes from its id (slurm/job_env.sh,
        as Lightning's): clusters side by side on one machine need ids of their own, or two jobs of the
        same id, one in each, would both listen on one port of 127.0.0.1."""
        self.root = Path(root).resolve()
        self.cpus_per_node = cpus_per_node
        self.memory_mb = memory_mb
        self.first_job_id = first_job_id
        self.conf = self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (sbatch, squeue, scontrol) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 30) -> None:
        missing = missing_binaries()
        if missing:
            raise ClusterUnavailable(f"missing {', '.join(missing)}: apt-get install slurm-wlm munge")
        if os.geteuid() != 0:
            raise ClusterUnavailable("the local Slurm daemons run as root")
        ensure_munge()
        ensure_node_names_resolve()
        for sub in ("state", "log", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        with _starting_alone():
            self._write_conf()
            subprocess.run([_sbin("slurmctld"), "-f", str(self.conf)], env=self.env, check=True)
            for node in NODE_NAMES:
                subprocess.run([_sbin("slurmd"), "-f", str(self.conf), "-N", node], env=self.env, check=True)
            self._wait_until_idle(timeout_s)
        self._check_it_answers()

    def _check_it_answers(self) -> None:
        """The controller that answers on this cluster's port is its own (its state folder), not another's
        that holds the port."""
        shown = self.run("scontrol", "show", "config").stdout
        state = next(
            (line.split("=", 1)[1].strip() for line in shown.splitlines() if "StateSaveLocation" in line), ""
        )
        if not state or Path(state).resolve() != (self.root / "state").resolve():
            self._stop_daemons()  # those of its own that started: the other cluster's jobs go on
            raise ClusterUnavailable(
                f"another Slurm controller answers on this cluster's port (its state in {state or 'unknown'}); "
                f"logs in {self.root}/log"
            )

    def stop(self) -> None:
        # Cancel what is left (a failed test's jobs) first: slurmstepd outlives the daemons otherwise.
        self.run("scancel", "--user", "root")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.run("squeue", "-h").stdout.strip():
            time.sleep(0.5)
        self._stop_daemons()

    def _stop_daemons(self) -> None:
        for pid_file in self.root.glob("*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in self.root.glob("*.pid")):
            time.sleep(0.2)

    def run(
        self, *command: str, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (sbatch, scancel, scontrol, ...) against this cluster; `env` adds
        variables (a job submitted with sbatch's default --export=ALL sees them)."""
        full_env = {**self.env, **(env or {})}
        return subprocess.run(command, env=full_env, cwd=cwd, capture_output=True, text=True, check=False)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit and return the job id."""
        result = self.run("sbatch", "--parsable", *args, cwd=cwd, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Poll until the job has ended (`ENDED`); cancel it and raise after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in ENDED:
                return info
            time.sleep(0.5)
        self.run("scancel", job_id)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout_s:.0f} s")

    def __enter__(self) -> LocalSlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(NODE_NAMES))
        host = socket.gethostname()
        root = self.root
        self.conf.write_text(
            f"""ClusterName=local
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again cred_expire s after it stopped (default 120); releasing it sooner
# races the nodes' revoked credential ("Job credential revoked", the job fails).
AuthInfo=cred_expire=10
CredType=cred/munge
SlurmctldPort={ctld_port}
FirstJobId={self.first_job_id}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# A job that becomes eligible by the clock (a requeued job, once its credential expired) starts at the next
# scheduling pass, not at an event: every 60 s by default (backfill: 30 s). A requeued job started again
# 27 s after it stopped, now 11 s (cred_expire + 1). Two nodes and a few jobs make a pass cheap. (Starting
# it at once, `scontrol update StartTime=now`, failed one two-node job in three: the revoked credential.)
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=10
NodeName=node[1-{len(NODE_NAMES)}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node_ports[0]}-{node_ports[-1]}] CPUs={self.cpus_per_node} RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=debug Nodes=node[1-{len(NODE_NAMES)}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )

    def _wait_until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        out = ""
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T %D").stdout.strip()
            if out == f"idle {len(NODE_NAMES)}":
                return
            time.sleep(0.5)
        raise ClusterUnavailable(
            f"Slurm nodes not idle after {timeout_s:.0f} s (sinfo: {out!r}); logs in {self.root}/log"
        )


@contextlib.contextmanager
def _starting_alone() -> Iterator[None]:
    with open(STARTING_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except (ValueError, OSError):
        return False
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__)
        return 2
    cluster = LocalSlurmCluster(Path(argv[1]))
    if argv[0] == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
