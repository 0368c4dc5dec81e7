"""`python <script> args...` as a real process that starts without paying for its imports again.

About 150 tests run an entry point (src/train.py, eval.py, predict.py, export.py, scripts/...) as a real
process, and each such process used to spend 4-5 s of its life importing torch, Lightning, torchmetrics
and Hydra before doing what the test is about. Here the process is forked from a server that imported
them once per test worker: multiprocessing's forkserver, with those modules preloaded. The forked
process then sets itself up as `python <script>` would (argv, sys.path, the environment, the working
directory, stdin from /dev/null, unbuffered stdout and stderr into one file), runs the script as
`__main__`, runs the atexit handlers, and exits with the script's exit code, or 1 and a traceback.

DDP's other local ranks start the same way. Lightning's launcher (and hpctrain's) starts each as
`subprocess.Popen([python, <this script>, ...])`, a fresh interpreter that spent about 7 s importing
Lightning (torchmetrics imports torchvision, transformers and scipy with it) in each of the suite's
~100 multi-process runs. In a preloaded run such a Popen is answered by a copy of the process as it was
before the run began (forked at its start, `_Ranks`), which becomes the child of the run's rank 0 as a
Popen child would be: rank 0 waits for it, polls it, signals it, and it dies with rank 0 (hpctrain sets
PR_SET_PDEATHSIG in every local rank). Every other command rank 0 starts is a real Popen.

Only third-party modules are preloaded, never this project's own code, so a test that edits the project
sees its edits. What a preloaded process cannot show, fresh processes still show: how long a start
takes and what it imports (test_train.py), signals during start-up and launches (Popen in the tests that
signal, whose ranks are fresh interpreters too), ranks with different hash seeds, and every Slurm job.
HPCTRAIN_TEST_FRESH=1 makes every run and every rank a fresh interpreter, to check that nothing depends
on this.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import io
import itertools
import json
import multiprocessing
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from multiprocessing import process as mp_process
from pathlib import Path
from typing import Any, NoReturn

# What every entry point imports first and longest; a module missing here is imported by the run.
PRELOAD = (
    "numpy",
    "torch",
    "torchmetrics",
    "pytorch_lightning",
    "lightning",
    "hydra",
    "omegaconf",
    "yaml",
    "rich",
    "sklearn.datasets",  # the digits of experiment=quickstart, the tests' most common run (0.26 s)
)
FRESH = os.environ.get("HPCTRAIN_TEST_FRESH", "") not in ("", "0")

_context: multiprocessing.context.ForkServerContext | None = None
_base_path: list[str] | None = None


def _installation_path() -> list[str]:
    """sys.path of a fresh interpreter without its first entry and PYTHONPATH: the standard library and
    site-packages (this process's own sys.path also holds what pytest put there)."""
    global _base_path
    if _base_path is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        printed = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        _base_path = json.loads(printed.stdout)
    return _base_path


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def _exit_code(code: object) -> int:
    """What the interpreter makes of `sys.exit(code)`: None is 0, an int is itself, anything else is
    printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _as_python_would(
    script: str, args: list[str], cwd: str, env: dict[str, str], output: str, base_path: list[str]
) -> None:
    """The forked process: become `python -u <script> args...` and run it; never returns."""
    ranks = _Ranks(base_path)  # before anything of the run (its files too): its other ranks start from here
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(output, os.O_WRONLY | os.O_APPEND)
    subprocess.Popen = type("Popen", (_RankOrCommand,), {"ranks": ranks})  # type: ignore[misc]
    _become(script, args, cwd, env, [stdin, out, out], base_path)


def _become(
    script: str, args: list[str], cwd: str, env: dict[str, str], fds: list[int], base_path: list[str]
) -> None:
    """Take `fds` as stdin, stdout and stderr, set up as `python -u <script> args...` would and run it;
    never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's stdin, open until it exits)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.enable()  # as PYTHONFAULTHANDLER=1 (local_env) would: a SIGABRT on a timeout dumps the stacks
    # The main process of a new interpreter, with the platform's default start method (fork), not a
    # child of the forkserver that would start its own children through the forkserver too.
    me = multiprocessing.current_process()
    me._identity, me._name, me._parent_pid = (), "MainProcess", None
    me._config = {"authkey": mp_process.AuthenticationString(os.urandom(32)), "semprefix": "/mp"}
    mp_process._parent_process = None
    mp_process._process_counter = itertools.count(1)
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    # sys.path as the interpreter builds it: the script's folder, PYTHONPATH, then the installation's.
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *pythonpath, *base_path]
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        try:  # as the interpreter ends: wait for the non-daemon threads first
            threading._shutdown()
        finally:
            end_without_teardown(code)


def end_without_teardown(code: int) -> NoReturn:
    """End this process with exit status `code` after its atexit handlers, as the interpreter would, but
    without freeing its objects one by one: 1.4 to 1.8 s once torch, Lightning and torchmetrics are imported."""
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(
    script: Path, args: list[str], cwd: Path, env: dict[str, str], timeout: float, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, script, *args], stdout=PIPE, stderr=STDOUT, text=True, ...)`, forked from
    the preloaded server; a fresh interpreter if `fresh` or under HPCTRAIN_TEST_FRESH=1."""
    command = [sys.executable, str(script), *args]
    if fresh or FRESH:
        with subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as popen:
            try:
                out, _ = popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _abort_tree(popen.pid)
                out, _ = popen.communicate()
                raise Hung(command, timeout, output=out) from None
        return subprocess.CompletedProcess(command, popen.returncode, stdout=out, stderr=None)
    with tempfile.NamedTemporaryFile(prefix="preloaded-", suffix=".out") as output:
        process = _forkserver().Process(
            target=_as_python_would,
            args=(str(script), list(args), str(cwd), dict(env), output.name, _installation_path()),
        )
        # multiprocessing would have the child import this process's main script again when that is a
        # file (the pytest console script, or a script that uses these helpers); it needs nothing of it.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            process.start()
        finally:
            sys.modules["__main__"] = main
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            _abort_tree(process.pid)
            process.join()
        text = Path(output.name).read_bytes().decode(errors="replace")
    if timed_out:
        raise Hung(command, timeout, output=text)
    # A process killed by a signal has exitcode -signum, as subprocess reports it.
    return subprocess.CompletedProcess(command, process.exitcode, stdout=text, stderr=None)


class Hung(subprocess.TimeoutExpired):
    """A run that outlived its timeout: the message ends with its last output, which holds every thread's
    stack of each of its processes (`_abort_tree`), so that a hang seen once in CI says where it was."""

    def __str__(self) -> str:
        tail = "\n".join((self.output or "").splitlines()[-150:])
        return f"{super().__str__()}; its last output, with each process's stacks:\n{tail}"


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (DDP's other ranks, loader workers), children before their children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        kids = children.get(queue.pop(0), [])
        found += kids
        queue += kids
    return found


def _abort_tree(pid: int) -> None:
    """SIGABRT to `pid` and everything under it (faulthandler, on in each, writes every thread's stack to
    the shared output), then SIGKILL to what is left: no rank outlives its test to slow the next ones."""
    tree = [pid, *_descendants(pid)]
    for each in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGABRT)
    time.sleep(3)
    for each in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value)


class _Ranks:
    """A copy of a preloaded process as it was before its run began, which starts the run's other local
    ranks (`_RankOrCommand`) as children of the run's process, without importing anything again."""

    def __init__(self, base_path: list[str]) -> None:
        self.rank0 = os.getpid()
        self.requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            self.requests.close()
            self._serve(theirs, base_path)
        theirs.close()
        self.reaping = False

    def start(self, script: str, args: list[str], cwd: str, env: dict[str, str]) -> int:
        """A rank running `python <script> args...` with this process's stdin, stdout and stderr: its pid,
        once it is this process's child."""
        if not self.reaping:  # the rank's first parent exits at once: it then comes to this process
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
            self.reaping = True
        request = pickle.dumps((script, args, cwd, env))
        socket.send_fds(self.requests, [request], [0, 1, 2])
        return int(self.requests.recv(64))

    def _serve(self, requests: socket.socket, base_path: list[str]) -> None:
        """The copy's life: a rank for each request, until the run's process ends (so does the copy)."""
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self.rank0:
            os._exit(0)
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(requests, 1 << 22, 3)
            except OSError:
                os._exit(0)
            if not message:
                os._exit(0)
            script, args, cwd, env = pickle.loads(message)
            started_r, started_w = os.pipe()
            middle = os.fork()
            if middle == 0:
                if os.fork() == 0:  # the rank: the child of the run's process once `middle` is gone
                    requests.close()
                    os.close(started_r)
                    while os.getppid() != self.rank0:
                        time.sleep(0.001)
                    os.write(started_w, str(os.getpid()).encode())
                    os.close(started_w)
                    _become(script, args, cwd, env, fds, base_path)
                os._exit(0)
            os.waitpid(middle, 0)
            os.close(started_w)
            for fd in fds:
                os.close(fd)
            pid = os.read(started_r, 64) or b"-1"
            os.close(started_r)
            requests.send(pid)


class _RankOrCommand(subprocess.Popen):
    """`subprocess.Popen` in a preloaded run: a command that reruns the run's own script with this
    interpreter and inherited stdin, stdout and stderr (a local rank, from Lightning's launcher or
    hpctrain's) is started by `_Ranks`; any other command as Popen starts it. Waiting, polling and
    signalling are Popen's own: the rank is this process's child. `_execute_child` and `_child_created`
    are CPython's private Popen hooks (the same from 3.10 to 3.13); every DDP test in the suite runs them,
    and HPCTRAIN_TEST_FRESH=1 does without them."""

    ranks: _Ranks  # the run's (`_as_python_would` makes the subclass that is subprocess.Popen there)

    def __init__(self, args: Any, *more: Any, **options: Any) -> None:
        inherits = not more and all(
            options.get(name) is None for name in ("stdin", "stdout", "stderr", "executable", "preexec_fn")
        )
        self._a_rank = inherits and not options.get("shell") and self._is_a_rank(args)
        super().__init__(args, *more, **options)

    @staticmethod
    def _is_a_rank(args: Any) -> bool:
        return (
            isinstance(args, (list, tuple))
            and len(args) >= 2
            and args[0] == sys.executable
            and os.path.abspath(str(args[1])) == os.path.abspath(sys.argv[0])
        )

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                       cwd: Any, env: Any, *rest: Any) -> None:  # fmt: skip
        if not self._a_rank:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)
        where = os.path.abspath(cwd) if cwd is not None else os.getcwd()
        self.pid = self.ranks.start(str(args[1]), [str(a) for a in args[2:]], where, dict(env or os.environ))
        self._child_created = True
        return None
