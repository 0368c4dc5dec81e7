"""Notifications: one short message to a webhook when a run ends, hangs or runs out of requeues, and when
a sweep ends, so that nobody has to watch the queue.

The webhook takes Slack's JSON, `{"text": "..."}` (Mattermost, Rocket.Chat and others take the same).
Its URL is a secret (whoever holds it can post to the channel), so it is read only from the environment,
from the variable `notify.url_env` names (HPCTRAIN_NOTIFY_URL by default): notifications are on where it
is set. The URL is never written anywhere: a `notify.url` in the config or on the command line is refused
(`hpctrain.runtime.config.checks`), and warnings name the webhook's host, never its URL.

Who posts what, once (a process posts at most one ending: completed, failed, nan, hung or budget):
- completed (the monitored metric's best value), failed (the one-sentence error): rank 0, as the job ends
  (`hpctrain.runtime.run.job`);
- failed (a crash), hung (a collective that timed out): the rank that records the job's failure
  (`failures.announce`; the job's store lets one rank do it);
- nan: rank 0, as the NaN stop raises (`hpctrain.callbacks.non_finite_loss`);
- budget: a job that has used its last requeue: rank 0 as the job ends on its one-sentence stop
  (`endings.Stopped`), or whoever finds it first with `notify.post(notify.BUDGET, sentence)`;
- sweep: the sweep's summary as the sweep ends (`sweep_ended`, from `hpctrain.runtime.sweeps.summary`);
  the points of a sweep leave completed, failed and nan to it.

A webhook never fails or slows a run: each message is posted from a daemon thread, whatever goes wrong is
one warning, and at the process's end (`atexit`, or `failures.exit_with` before a rank ends itself) the
wait is bounded by `notify.timeout_s` from the moment the message was posted. Standard library only.

    notify.configure(settings.notify, run_dir)     # every rank, as each job starts (`Job` does it)
    notify.post(notify.BUDGET, "the job has been requeued 3 times (requeue.max_attempts=3); ...")
    notify.wait()                                  # bounded; at exit it runs by itself
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hpctrain.runtime import run_state
from hpctrain.runtime.config.settings import Notify
from hpctrain.runtime.distributed.endings import STOPPED, ending
from hpctrain.runtime.environment import launched
from hpctrain.runtime.errors import UserError

log = logging.getLogger("hpctrain")

COMPLETED, FAILED, NAN, HUNG, BUDGET, SWEEP = "completed", "failed", "nan", "hung", "budget", "sweep"
EVENTS = (COMPLETED, FAILED, NAN, HUNG, BUDGET, SWEEP)
ENDINGS = (COMPLETED, FAILED, NAN, HUNG, BUDGET)  # how a run ends: one per process
SUMMARISED = (COMPLETED, FAILED, NAN)  # a sweep's point leaves these to the sweep's summary
HEADLINES = {
    COMPLETED: "run completed",
    FAILED: "run failed",
    NAN: "run stopped: the training loss is not finite",
    HUNG: "run hung",
    BUDGET: "run out of requeues",
    SWEEP: "sweep ended",
}


@dataclass
class _Pending:
    thread: threading.Thread
    deadline: float  # time.monotonic() by which the post must be done
    event: str
    timeout_s: float


@dataclass
class Notifier:
    """One run's notifications (`hpctrain.runtime.run_state`): its settings, whether its ending was posted,
    and the posts still on their way (waited for at the process's exit, whichever run is current then)."""

    url_env: str = Notify.url_env  # the settings' defaults until `configure`
    timeout_s: float = Notify.timeout_s
    events: tuple[str, ...] = EVENTS  # the ones posted
    where: str | None = None  # the run dir (or sweep dir) the messages name
    sweep_point: bool = False  # a job of a sweep (-m): its summary says how it ended
    ended: bool = False  # this job's ending has been posted (or left to the summary)
    warned: bool = False  # one warning per job
    pending: list[_Pending] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    waits_at_exit: bool = False

    def wait(self) -> None:
        """This notifier's posts still on their way, each until `timeout_s` after it was posted at most."""
        waited = list(self.pending)
        for pending in waited:
            pending.thread.join(max(0.0, pending.deadline - time.monotonic()))
            if pending.thread.is_alive():
                self.warn(
                    pending.event, f"the webhook did not answer within notify.timeout_s={pending.timeout_s:g}"
                )
        self.pending = [p for p in self.pending if p not in waited]

    def warn(self, event: str, why: str) -> None:
        """One warning per job, naming the variable, never the URL."""
        with self.lock:
            if self.warned:
                return
            self.warned = True
        url = os.environ.get(self.url_env, "")
        said = why.replace(url, f"${self.url_env}") if url else why
        log.warning("notify: the %s notification was not sent: %s; the run is not affected.", event, said)


def _notifier() -> Notifier:
    return run_state.part(Notifier)


def configure(settings: Notify, where: str | Path | None, sweep_point: bool = False) -> None:
    """Use the `notify:` settings (checked in the preflight) for the job about to start in `where`."""
    state = _notifier()
    state.url_env, state.timeout_s = settings.url_env, float(settings.timeout_s)
    state.events = tuple(settings.events)
    state.where = str(where) if where is not None else None
    state.sweep_point = sweep_point
    state.ended = state.warned = False


def post(event: str, text: str) -> bool:
    """Post `text` as `event` (one of EVENTS) from a daemon thread; whether a message went out. An ending
    (completed, failed, nan, hung, budget) after this job's first is dropped."""
    state = _notifier()
    with state.lock:
        if event in ENDINGS:
            if state.ended:
                return False
            state.ended = True
    url = os.environ.get(state.url_env, "").strip()
    if not url or event not in state.events or (state.sweep_point and event in SUMMARISED):
        return False
    body = json.dumps({"text": message(event, text, state.where)}).encode()
    thread = threading.Thread(
        target=_send,
        args=(state, url, body, event, state.url_env, state.timeout_s),
        name="notify",
        daemon=True,
    )
    state.pending.append(_Pending(thread, time.monotonic() + state.timeout_s, event, state.timeout_s))
    thread.start()
    if not state.waits_at_exit:
        # atexit is the process's: it waits for this notifier's posts even after its run has ended
        # (a sweep's next job, or the sweep's summary, may be current by then), as bounded as ever
        atexit.register(state.wait)
        state.waits_at_exit = True
    return True


def wait() -> None:
    """Wait for the messages still being posted, each until `notify.timeout_s` after it was posted at most.
    A wait inside a wait (a signal handler that ends the process) waits for the same messages."""
    _notifier().wait()


def job_ended(
    err: BaseException | None,
    metric: str | None = None,
    value: float | None = None,
    test: Mapping[str, float] | None = None,
) -> None:
    """Rank 0, as a job ends: completed, with its monitored metric's best value (and test metrics), or
    failed, with the one sentence that stopped it (budget: a requeue budget spent, `endings.Stopped`). A
    crash is posted by the rank that reports it (`failures`); a signal's stop or requeue posts nothing."""
    if err is None:
        post(COMPLETED, result(metric, value, test))
    elif isinstance(err, UserError):  # a mistake, or a stop said in one sentence: a requeue budget spent
        post(BUDGET if ending(err).status == STOPPED else FAILED, str(err))


def sweep_ended(settings: Notify, sweep_dir: str | Path, text: str) -> None:
    """The process that ran a sweep, at its end: post its summary."""
    configure(settings, sweep_dir)
    post(SWEEP, text)


def result(metric: str | None, value: float | None, test: Mapping[str, float] | None = None) -> str:
    shown = [f"{metric}={value:.4g} (best)"] if metric and value is not None else []
    shown += [f"{name}={number:.4g}" for name, number in sorted((test or {}).items())]
    return ", ".join(shown) or "no monitored metric"


def message(event: str, text: str, where: str | None = None) -> str:
    """The message: the event and what happened, then the run dir, the Slurm job and the host."""
    lines = [f"hpctrain: {HEADLINES.get(event, event)}: {text}"]
    if where:
        lines.append(f"{'sweep' if event == SWEEP else 'run'} dir: {where}")
    job = launched.slurm_job_id()
    if job:
        lines.append(f"Slurm job: {job}")
    lines.append(f"host: {launched.node_name()}")
    # Slack reads <...> as a link and & as an entity: escape them as its documentation says
    return "\n".join(lines).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _send(state: Notifier, url: str, body: bytes, event: str, url_env: str, timeout_s: float) -> None:
    """From a daemon thread: a warning goes to the notifier that posted it, whichever run is current."""
    warn = state.warn
    try:
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            answer.read(4096)
    except urllib.error.HTTPError as err:
        warn(
            event,
            f"the webhook at {_host(url)} answered HTTP {err.code} {err.reason}; check the URL in ${url_env}",
        )
    except urllib.error.URLError as err:
        warn(event, _unreachable(url, err.reason, timeout_s))
    except TimeoutError:  # connected, then no answer
        warn(event, f"the webhook at {_host(url)} did not answer within notify.timeout_s={timeout_s:g}")
    except OSError as err:
        warn(event, _unreachable(url, err, timeout_s))
    except ValueError:  # what urllib says repeats the URL: say it without
        warn(event, f"${url_env} does not hold an http(s) URL")
    except Exception as err:
        warn(event, f"posting to {_host(url)} failed ({type(err).__name__})")


def _unreachable(url: str, reason: object, timeout_s: float) -> str:
    if isinstance(reason, socket.gaierror):
        why = "its name does not resolve"
    elif isinstance(reason, ConnectionRefusedError):
        why = "connection refused"
    elif isinstance(reason, TimeoutError):
        why = f"no answer within notify.timeout_s={timeout_s:g}"
    else:
        why = type(reason).__name__ if isinstance(reason, BaseException) else str(reason)
    return (
        f"could not reach the webhook at {_host(url)} ({why}), as on a compute node without outbound network "
        "access; set https_proxy to your site's proxy, or leave the URL unset in jobs there"
    )


def _host(url: str) -> str:
    """The webhook's host and port: what a message may say of its URL."""
    try:
        parts = urlsplit(url)
        return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    except ValueError:
        return "?"
