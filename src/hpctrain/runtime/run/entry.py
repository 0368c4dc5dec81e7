"""The first two lines every entry point runs, before anything else is imported, and its last one."""

from __future__ import annotations

import sys
from typing import Any

from hpctrain.runtime.config import answers, checks, command_line, versions
from hpctrain.runtime.config.compose import project_packages
from hpctrain.runtime.distributed import signals
from hpctrain.runtime.errors import reported_as_one_sentence


def start(task: str) -> None:
    """Record SLURM's signals from the first moment (by default they kill), and have Hydra report
    composition mistakes as one sentence and list `--help`'s groups once (`command_line`). A `--help` or
    `--cfg job` asked before with the same conf/, code and command line is answered at once (`answers`).
    A secret on the command line (a webhook URL) is refused first, before anything can print or store it."""
    signals.install_early()
    with reported_as_one_sentence():
        checks.check_command_line(sys.argv[1:])
    command_line.install(task, answers.replay())


def main_args() -> dict[str, Any]:
    """`@hydra.main`'s arguments besides the config's folder and name (`**entry.main_args()`): Hydra 1.3's
    version_base, or Hydra 1.4's allowlist for the callbacks Hydra itself builds from `hydra.callbacks`,
    hpctrain's and the project's packages (hpctrain.runtime.config.versions)."""
    if not versions.HYDRA_1_4:
        return dict(versions.VERSION_BASE)
    return {"execution_whitelist": tuple(f"{package}.*" for package in ("hpctrain", *project_packages()))}


def end() -> None:
    """After `main()` returns: SIGTERM and SLURM's signals are ignored from here to the process's end (a
    late one would otherwise kill it as the interpreter finalizes: `signals.ignored_until_exit`), and a
    rank > 0 whose run completed leaves at once (`watchdog`). Only a job imports the watchdog, so `--cfg`
    and the other answers that run none do not import it here either."""
    signals.ignored_until_exit()
    watchdog = sys.modules.get("hpctrain.runtime.distributed.watchdog")
    if watchdog is not None:
        watchdog.exit_if_finished_worker()
