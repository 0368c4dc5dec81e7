"""How a run ended, decided in one place: by the exception that left it (None: it returned).

    completed  it returned (or exited with status 0)
    refused    a mistake the template recognised (UserError): one sentence, exit status 2
    requeued   a signal under SLURM: checkpoint, `scontrol requeue`, the job comes back
    stopped    a signal (SIGTERM) elsewhere, or Ctrl-C: checkpoint if training, exit 143; or a requeue
               budget spent (`Stopped`: its sentence, exit status 2)
    exited     sys.exit with a non-zero status (its own message was printed already)
    failed     anything else: a crash, reported with the rank that failed first (watchdog)

The watchdog treats every ending but `failed` as on purpose; outcome.yaml records the ending.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.runtime.distributed.signals import Interrupted
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.secrets import hide

COMPLETED, REFUSED, REQUEUED, STOPPED, EXITED, FAILED = (
    "completed",
    "refused",
    "requeued",
    "stopped",
    "exited",
    "failed",
)


class Stopped(UserError):
    """The job ends on purpose before it completed, said in one sentence like a mistake (`error: ...`,
    exit status 2) and recorded as stopped: a requeue budget was spent (hpctrain.runtime.storage.attempts)."""


@dataclass(frozen=True)
class Ending:
    status: str
    detail: str | None = None  # the sentence, the signal, or the error, for outcome.yaml

    def __post_init__(self) -> None:
        if self.detail:  # recorded and posted: a URL's secret parts hidden (hpctrain.runtime.secrets)
            object.__setattr__(self, "detail", hide(self.detail))

    @property
    def on_purpose(self) -> bool:
        return self.status != FAILED


def ending(err: BaseException | None) -> Ending:
    if err is None:
        return Ending(COMPLETED)
    if isinstance(err, Stopped):
        return Ending(STOPPED, str(err))
    if isinstance(err, UserError):
        return Ending(REFUSED, str(err))
    if isinstance(err, Interrupted):
        return Ending(REQUEUED if err.requeue else STOPPED, str(err))
    if isinstance(err, KeyboardInterrupt):
        return Ending(STOPPED, "interrupted (Ctrl-C)")
    if isinstance(err, SystemExit):
        return Ending(COMPLETED) if err.code in (0, None) else Ending(EXITED, f"exit status {err.code}")
    return Ending(FAILED, " ".join(f"{type(err).__name__}: {err}".split())[:500])
