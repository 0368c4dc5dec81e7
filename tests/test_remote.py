"""scripts/submit.py --remote against a real sshd on this machine (Debian's openssh-server, a key made
here, the test's own sshd config) and the real two-node Slurm cluster behind it: submit, status, logs,
fetch, and a hostile override value that arrives as text and is never executed."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHON, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


@pytest.fixture
def sshd(slurm_cluster, tmp_path: Path):
    """An sshd on a free local port that accepts only a key made here; its sessions talk to the test cluster."""
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd_bin).exists() or shutil.which("rsync") is None:
        pytest.fail(
            "openssh-server and rsync are needed: apt-get install openssh-server rsync (.ci/run does)"
        )
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True
        )
    (tmp_path / "authorized_keys").write_text((tmp_path / "user_key.pub").read_text())
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path}/host_key\nPidFile {tmp_path}/sshd.pid\n"
        f"AuthorizedKeysFile {tmp_path}/authorized_keys\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
        f"SetEnv SLURM_CONF={slurm_cluster.conf}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    server = subprocess.Popen(
        [sshd_bin, "-D", "-e", "-f", str(tmp_path / "sshd_config")], stderr=subprocess.PIPE
    )
    (tmp_path / "ssh_config").write_text(
        f"Host cluster-login\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {tmp_path}/user_key\n"
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


def test_submit_status_logs_and_fetch_over_ssh(slurm_cluster, sshd: Path, tmp_path: Path):
    remote_dir = tmp_path / "on-the-cluster"  # the remote project: its own venv, logs and data
    remote_dir.mkdir()
    (remote_dir / ".venv").symlink_to(ROOT / ".venv")
    marker = tmp_path / "executed"
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

    bad = subprocess.run(
        [PYTHON, "scripts/submit.py", *remote, "--status", "1; touch " + str(marker)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "is not a SLURM job id" in bad.stderr and not marker.exists()
