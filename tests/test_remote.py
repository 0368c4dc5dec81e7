"""scripts/submit.py --remote against a real sshd on this machine (Debian's openssh-server, a key made
here, the test's own sshd config), logging in as a user who is not root, and the real two-node Slurm
cluster behind it: submit, status, logs, fetch, and a hostile override value that arrives as text and
is never executed."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHON, ROOT, require_programs

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


USER = "hpcremote"


@pytest.fixture
def remote_user() -> pwd.struct_passwd:
    """A user who is not root, with a home of its own, who may run the project's venv: its interpreter
    lives under /root, which only root may enter, so the user gets to pass through /root (an ACL entry
    for this user alone: search, not read)."""
    require_programs("setfacl", "useradd", install="apt-get install acl passwd (.ci/run does)")
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True)
    subprocess.run(["usermod", "-p", "*", USER], check=True)  # no password, but not locked: keys work
    python = Path(os.path.realpath(ROOT / ".venv" / "bin" / "python"))
    for parent in [p for p in (*python.parents, *ROOT.parents) if p != Path("/")]:
        if not os.access(parent, os.X_OK, effective_ids=False) or parent == Path("/root"):
            subprocess.run(["setfacl", "-m", f"u:{USER}:x", str(parent)], check=True)
    return pwd.getpwnam(USER)


@pytest.fixture
def sshd(slurm_cluster, remote_user: pwd.struct_passwd, tmp_path: Path):
    """An sshd on a free local port that accepts only a key made here, for the remote user; its sessions
    talk to the test cluster (its slurm.conf copied where that user can read it)."""
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd_bin).exists() or shutil.which("rsync") is None:
        pytest.fail(
            "openssh-server and rsync are needed: apt-get install openssh-server rsync (.ci/run does)"
        )
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True
        )
    # slurmd copies each batch script into its spool dir, inside the test's temporary folder, and runs it as
    # the user who submitted it: that user must be able to pass through the folders above it
    spool = slurm_cluster.root / "spool"
    for folder in [*(node for node in spool.iterdir() if node.is_dir()), spool, *spool.parents]:
        if folder in (Path("/"), Path("/tmp")):
            break
        subprocess.run(["setfacl", "-m", f"u:{USER}:x", str(folder)], check=True)
    shared = Path(f"/tmp/hpctrain-remote-{os.getpid()}")  # readable by the remote user
    shared.mkdir(mode=0o755, exist_ok=True)
    shutil.copy(slurm_cluster.conf, shared / "slurm.conf")
    os.chmod(shared / "slurm.conf", 0o644)
    shutil.copy(tmp_path / "user_key.pub", shared / "authorized_keys")
    os.chmod(shared / "authorized_keys", 0o644)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path}/host_key\nPidFile {tmp_path}/sshd.pid\n"
        f"AuthorizedKeysFile {shared}/authorized_keys\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"PermitRootLogin no\nAllowUsers {USER}\nStrictModes no\nUsePAM no\n"
        f"SetEnv SLURM_CONF={shared}/slurm.conf\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    server = subprocess.Popen(
        [sshd_bin, "-D", "-e", "-f", str(tmp_path / "sshd_config")], stderr=subprocess.PIPE
    )
    (tmp_path / "ssh_config").write_text(
        f"Host cluster-login\n  HostName 127.0.0.1\n  Port {port}\n  User {USER}\n  IdentityFile {tmp_path}/user_key\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    deadline = time.monotonic() + 20
    while (
        subprocess.run(["ssh", "-F", str(tmp_path / "ssh_config"), "cluster-login", "true"]).returncode != 0
    ):
        assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()[-2000:]
        time.sleep(0.3)
    yield tmp_path / "ssh_config"
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=10)
    shutil.rmtree(shared, ignore_errors=True)


def test_submit_status_logs_and_fetch_over_ssh(slurm_cluster, sshd: Path, remote_user, tmp_path: Path):
    remote_dir = (
        Path(remote_user.pw_dir) / f"project-{os.getpid()}"
    )  # the remote project: its venv, logs, data
    shutil.rmtree(remote_dir, ignore_errors=True)
    remote_dir.mkdir()
    (remote_dir / ".venv").symlink_to(ROOT / ".venv")
    os.chown(remote_dir, remote_user.pw_uid, remote_user.pw_gid)
    marker = Path(f"/tmp/hpctrain-executed-{os.getpid()}")  # where the remote user could write, too
    remote = ("--remote", f"cluster-login:{remote_dir}", "--ssh-config", str(sshd))
    submitted = subprocess.run(
        [
            PYTHON,
            "scripts/submit.py",
            *remote,
            "--nodes",
            "1",
            "--cpu",
            "--cpus-per-task",
            "1",
            "--mem",
            "1G",
            "--",
            "experiment=quickstart",
            "trainer.max_epochs=1",
            "extras.print_config=false",
            f"tags=['$(touch {marker})', '`touch {marker}`; touch {marker}']",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job = submitted.stdout.split("job ")[-1].split()[0]
    assert job.isdigit() and f"job {job} on cluster-login" in submitted.stdout
    (snapshot,) = (remote_dir / "logs" / "snapshots").iterdir()
    assert (snapshot / "src" / "train.py").is_file() and (snapshot / "SNAPSHOT.yaml").is_file()

    status = subprocess.run(
        [PYTHON, "scripts/submit.py", *remote, "--status", job], cwd=ROOT, capture_output=True, text=True
    )
    assert status.returncode == 0 and f"job {job}: JobState=" in status.stdout, status.stderr
    info = slurm_cluster.wait(job, timeout_s=300)
    assert info["JobState"] == "COMPLETED"
    logs = subprocess.run(
        [PYTHON, "scripts/submit.py", *remote, "--logs", job], cwd=ROOT, capture_output=True, text=True
    )
    assert logs.returncode == 0 and f"runs/slurm-{job}" in logs.stdout, logs.stderr  # its last lines

    local_logs = ROOT / "logs" / "remote" / "cluster-login"
    try:
        fetched = subprocess.run(
            [PYTHON, "scripts/submit.py", *remote, "--fetch", job], cwd=ROOT, capture_output=True, text=True
        )
        assert fetched.returncode == 0, fetched.stderr
        run = local_logs / "train" / "runs" / f"slurm-{job}"
        assert (run / "run.yaml").is_file() and (run / "metrics.csv").is_file()
        assert not (run / "checkpoints").exists()  # without --with-checkpoints
        record = (run / "config.yaml").read_text()
        assert f"$(touch {marker})" in record  # the hostile value arrived as text
    finally:
        shutil.rmtree(local_logs, ignore_errors=True)
    assert not marker.exists()  # ... and was never executed, here or there

    assert (snapshot / "src").stat().st_uid == remote_user.pw_uid  # the remote user's files, sent by rsync
    shutil.rmtree(remote_dir, ignore_errors=True)
    bad = subprocess.run(
        [PYTHON, "scripts/submit.py", *remote, "--status", "1; touch " + str(marker)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "is not a SLURM job id" in bad.stderr and not marker.exists()
