"""`python <script> args...` as a real process that starts without paying for its imports again.

About 150 tests run an entry point (src/train.py, eval.py, predict.py, export.py, scripts/...) as a real
process, and each such process used to spend 4-5 s of its life importing torch, Lightning, torchmetrics
and Hydra before doing what the test is about. Here the process is forked from a server that imported
them once per test worker: multiprocessing's forkserver, with those modules preloaded. The forked
process then sets itself up as `python <script>` would (argv, sys.path, the environment, the working
directory, stdin from /dev/null, unbuffered stdout and stderr into one file), runs the script as
`__main__`, runs the atexit handlers, and exits with the script's exit code, or 1 and a traceback.

Only third-party modules are preloaded, never this project's own code, so a test that edits the project
sees its edits. What a preloaded process cannot show, fresh processes still show: how long a start
takes and what it imports (test_train.py), signals during start-up and launches (Popen in the tests that
signal), DDP's other ranks (started by Lightning's launcher as fresh interpreters) and every Slurm job.
HPCTRAIN_TEST_FRESH=1 makes every run a fresh interpreter, to check that nothing depends on this.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import itertools
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from multiprocessing import process as mp_process
from pathlib import Path

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
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's stdin, open until it exits)
    out = os.open(output, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
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
        try:  # as the interpreter ends: wait for the non-daemon threads, then the atexit handlers
            threading._shutdown()
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
