"""Submitting from a laptop to a cluster behind SSH: scripts/submit.py --remote <[user@]host>[:<dir>].

The system's ssh and rsync do the work, so the user's SSH config applies (ProxyJump, ControlMaster,
keys); `--ssh-config FILE` names another config file. What happens:

- submit: the code snapshot taken here (hpctrain.runtime.snapshot) is copied with rsync into the remote
  project's own snapshot store, `<dir>/logs/snapshots/<digest>/` (content-addressed: the same code is
  sent once), and that snapshot's scripts/submit.py runs there with the same arguments, with the remote
  project's venv (`<dir>/.venv/bin/python`, or `--remote-python`); it submits from the snapshot as a
  local submission would, and its job id is printed here;
- `--status JOB`, `--logs JOB` (the tail of the job's SLURM output) and `--fetch JOB` (its run dir,
  without checkpoints unless `--with-checkpoints`, into logs/remote/<host>/) use the same connection.

ssh always hands the remote side a command line that a shell parses, so every remote argument is
quoted (shlex.quote) and job ids are checked: an override such as `tags=['$(rm -rf ~)']` arrives as
the text it is and is never executed.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.snapshot import STORE, Snapshot

JOB_ID = re.compile(r"^\d+(_\d+)?$")


@dataclass(frozen=True)
class Remote:
    host: str  # [user@]host, as ssh takes it
    directory: str  # the remote project
    python: str
    ssh_config: Path | None = None

    @classmethod
    def parse(cls, target: str, python: str | None, ssh_config: str | None, project_name: str) -> Remote:
        host, _, directory = target.partition(":")
        if not host:
            raise UserError(
                f"--remote {target}: name the login node, e.g. --remote me@login.cluster.org[:~/project]."
            )
        directory = directory or f"~/{project_name}"
        return cls(
            host,
            directory,
            python or f"{directory}/.venv/bin/python",
            Path(ssh_config) if ssh_config else None,
        )

    def _ssh(self) -> list[str]:
        return ["ssh", *(["-F", str(self.ssh_config)] if self.ssh_config else [])]

    def _path(self, path: str) -> str:
        """A remote path for the remote shell: `~/x` stays relative to the home directory, the rest is quoted."""
        if path == "~" or path.startswith("~/"):
            return '"$HOME"' + (shlex.quote(path[1:]) if len(path) > 1 else "")
        return shlex.quote(path)

    def run(self, command: str, in_project: bool = True) -> subprocess.CompletedProcess[str]:
        """`command` (already quoted) in the remote shell, from the remote project's directory."""
        full = f"cd {self._path(self.directory)} && {command}" if in_project else command
        return subprocess.run([*self._ssh(), self.host, full], capture_output=True, text=True, check=False)

    def rsync(self, source: str, target: str, exclude: tuple[str, ...] = ()) -> None:
        shell = shlex.join(self._ssh())
        command = ["rsync", "-a", "-e", shell, *(f"--exclude={e}" for e in exclude), source, target]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise UserError(
                f"rsync to or from {self.host} failed: {(done.stderr or done.stdout).strip()[:300]}"
            )

    def remote_path(self, relative: str) -> str:
        """`host:path` for rsync, relative to the remote project (rsync's remote shell expands `~`)."""
        base = self.directory.rstrip("/")
        return f"{self.host}:{base}/{relative}"

    # ------------------------------------------------------------------------------------ commands

    def submit(self, code: Snapshot, arguments: list[str]) -> str:
        """Send the snapshot, submit there with `arguments` (submit.py's, without the remote ones); the job id."""
        mkdir = self.run(f"mkdir -p {self._path(f'{self.directory}/{STORE}')}", in_project=False)
        if mkdir.returncode != 0:
            raise UserError(
                f"cannot reach {self.host} or write {self.directory} there: {mkdir.stderr.strip()[:300]}"
            )
        store = f"{STORE}/{code.path.name}"
        self.rsync(f"{code.path}/", self.remote_path(f"{store}/"))
        project = '"$PWD"'  # the remote project's directory, as its shell sees it after the cd
        command = (
            f"HPCTRAIN_PROJECT_ROOT={project} {self._path(self.python)} {shlex.quote(store)}/scripts/submit.py "
            + shlex.join(arguments)
        )
        done = self.run(command)
        print(done.stdout, end="")
        if done.returncode != 0:
            raise UserError(
                f"the submission on {self.host} failed: {(done.stderr or done.stdout).strip()[-500:]}"
            )
        found = re.search(r"Submitted batch job (\d+)", done.stdout)
        if found is None:
            raise UserError(f"the submission on {self.host} printed no job id: {done.stdout.strip()[-300:]}")
        return found.group(1)

    def status(self, job: str) -> str:
        _check(job)
        done = self.run(f"scontrol show job -o {shlex.quote(job)}")
        if done.returncode != 0:
            raise UserError(f"job {job} is not known on {self.host}: {done.stderr.strip()[:300]}")
        fields = dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)
        keys = ("JobState", "Reason", "RunTime", "TimeLimit", "Restarts", "NodeList")
        return f"job {job}: " + "  ".join(f"{k}={fields[k]}" for k in keys if k in fields)

    def logs(self, job: str, lines: int = 40) -> str:
        _check(job)
        command = (
            f"out=$(scontrol show job -o {shlex.quote(job)} | tr ' ' '\\n' | sed -n 's/^StdOut=//p') && "
            f'tail -n {int(lines)} "$out"'
        )
        done = self.run(command)
        if done.returncode != 0:
            raise UserError(f"no SLURM output of job {job} on {self.host}: {done.stderr.strip()[:300]}")
        return done.stdout

    def fetch(self, job: str, into: Path, with_checkpoints: bool = False) -> Path:
        """The job's run dir (`<remote project>/logs/<task>/runs/slurm-<job>`) into `into`."""
        _check(job)
        found = self.run(f"ls -d logs/*/runs/slurm-{shlex.quote(job)}")
        dirs = found.stdout.split()
        if found.returncode != 0 or not dirs:
            raise UserError(f"job {job} has no run dir under {self.directory}/logs/*/runs/ on {self.host}.")
        relative = dirs[0]
        target = into / Path(relative).relative_to("logs")
        target.mkdir(parents=True, exist_ok=True)
        exclude = () if with_checkpoints else ("checkpoints/",)
        self.rsync(self.remote_path(f"{relative}/"), f"{target}/", exclude)
        return target


def _check(job: str) -> None:
    if not JOB_ID.match(job):
        raise UserError(f"{job!r} is not a SLURM job id (digits, or <array job>_<task>).")
