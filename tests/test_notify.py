"""Notifications and what trackers are told about a job: a local webhook (http.server in a thread)
receives what real runs post (completed with its metric, a crash's sentence, a NaN stop, a hung rank, a
sweep's summary), a webhook that hangs or cannot be reached costs one warning and at most notify.timeout_s,
and the URL, a secret, is written nowhere; MLflow, TensorBoard and the csv logger get the Slurm job, the
allocation, the code and hpctrain's version."""

from __future__ import annotations

import html
import json
import logging
import os
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from hpctrain.loggers import job_metadata
from hpctrain.runtime.config import schema
from hpctrain.runtime.config.checks import check_command_line, check_config, notify_url_refused
from hpctrain.runtime.config.settings import Notify
from hpctrain.runtime.distributed import notify
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.sweeps.summary import Summary
from tests.helpers import (
    ROOT,
    assert_ok,
    compose_train,
    require_modules,
    run_dirs,
    run_entry,
    train,
)

SECRET = "T0kenXq93zSecretPath"  # the part of a webhook URL that must never be written anywhere
QUICK = ("experiment=quickstart", "trainer.max_epochs=1", "trainer.limit_train_batches=0.3")
FAST = ("data=digits", "trainer=cpu", "logger=csv", "debug=fdr")  # one batch of each: seconds


class Webhook:
    """A Slack-compatible webhook on this machine: records each posted text and when it arrived;
    `delay_s` makes it hang that long before it answers."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.posts: list[tuple[float, str]] = []
        self.delay_s = delay_s
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts.append((time.monotonic(), html.unescape(json.loads(body)["text"])))
                time.sleep(hook.delay_s)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/services/{SECRET}"

    @property
    def texts(self) -> list[str]:
        return [text for _, text in self.posts]

    def env(self) -> dict[str, str]:
        return {"HPCTRAIN_NOTIFY_URL": self.url, "no_proxy": "*", "NO_PROXY": "*"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/services/{SECRET}"


def warnings_in(output: str) -> list[str]:
    return [line for line in output.splitlines() if "notify: " in line]


def files_holding(folder: Path, text: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


# ------------------------------------------------------------------------------------ quick: the module


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """notify set up for a job in a tmp run dir, outside SLURM; what it posts is waited for at the end."""
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "*")
    notify.configure(Notify(), tmp_path)
    yield tmp_path
    notify.wait()
    notify.configure(Notify(), None)


def test_the_schema_lists_notifys_events():
    assert schema.NOTIFY_EVENTS == notify.EVENTS


@pytest.mark.parametrize(
    "override",
    [
        f"notify.url=https://hooks.example.com/{SECRET}",
        f"+notify.url=https://hooks.example.com/{SECRET}",
        f"++notify.url=https://hooks.example.com/{SECRET}",
        f"notify={{url: 'https://hooks.example.com/{SECRET}'}}",
        f"notify.url_env=https://hooks.example.com/{SECRET}",
        f"hydra.job.env_set.HPCTRAIN_NOTIFY_URL=https://hooks.example.com/{SECRET}",  # .hydra/hydra.yaml
        f"+tags=[https://hooks.example.com/{SECRET}]",  # the environment's very URL, under any key
    ],
)
def test_a_webhook_url_on_the_command_line_is_refused_without_repeating_it(
    override: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HPCTRAIN_NOTIFY_URL", f"https://hooks.example.com/{SECRET}")
    with pytest.raises(UserError) as refused:
        check_command_line(["experiment=quickstart", override])
    key = override.lstrip("+").partition("=")[0]
    assert str(refused.value) == str(notify_url_refused(key)) and SECRET not in str(refused.value)
    check_command_line(
        ["notify.url_env=MY_WEBHOOK", "notify.timeout_s=2", "notify.events=[failed,hung]", "-m"]
    )


def test_a_webhook_url_in_a_config_file_is_refused(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, f"+notify.url=https://hooks.example.com/{SECRET}")
    with pytest.raises(UserError, match=r"notify\.url holds the webhook URL"):
        check_config(cfg)
    check_config(compose_train(tmp_path, data_dir, "notify.events=[failed,hung]", "notify.timeout_s=0.5"))
    with pytest.raises(UserError, match=r"notify\.events=.* is not a list of completed, failed"):
        check_config(compose_train(tmp_path, data_dir, "notify.events=[done]"))


def test_a_message_names_the_event_the_run_dir_the_slurm_job_and_the_host(
    fresh: Path, webhook: Webhook, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HPCTRAIN_NOTIFY_URL", webhook.url)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "node07")
    assert notify.post(notify.FAILED, "data.batch_size=0 is not a positive integer; pass <value> & go")
    notify.wait()
    assert webhook.texts == [
        "hpctrain: run failed: data.batch_size=0 is not a positive integer; pass <value> & go\n"
        f"run dir: {fresh}\nSlurm job: 4242\nhost: node07"
    ]


def test_a_job_posts_one_ending_and_a_sweeps_point_leaves_its_ending_to_the_summary(
    fresh: Path, webhook: Webhook, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HPCTRAIN_NOTIFY_URL", webhook.url)
    assert notify.post(notify.NAN, "the training loss became nan at step 3")
    assert not notify.post(notify.FAILED, "the same stop, as the job ends")  # one ending per job
    assert notify.post(notify.SWEEP, "2 jobs")  # not an ending
    notify.configure(Notify(events=["failed"]), fresh)
    assert not notify.post(notify.COMPLETED, "val/acc=0.9")
    notify.configure(Notify(), fresh, sweep_point=True)
    assert not notify.post(notify.FAILED, "a point failed")
    notify.configure(Notify(), fresh, sweep_point=True)
    assert notify.post(notify.HUNG, "rank 1 hung")
    monkeypatch.delenv("HPCTRAIN_NOTIFY_URL")
    notify.configure(Notify(), fresh)
    assert not notify.post(notify.COMPLETED, "off: the variable is not set")
    notify.wait()
    posted = sorted(text.split(":")[1].strip() for text in webhook.texts)  # each from its own thread
    assert posted == ["run hung", "run stopped", "sweep ended"]


@pytest.mark.parametrize("why", ["connection refused", "its name does not resolve"])
def test_an_unreachable_webhook_is_one_warning_naming_an_offline_node(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, why: str
):
    if why == "connection refused":
        monkeypatch.setenv("HPCTRAIN_NOTIFY_URL", closed_port_url())
    else:  # a compute node without DNS for the outside world
        monkeypatch.setenv("HPCTRAIN_NOTIFY_URL", f"https://hooks.example.com/services/{SECRET}")

        def no_dns(*args: object, **kwargs: object) -> None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        notify.post(notify.SWEEP, "2 jobs")
        notify.post(notify.COMPLETED, "val/acc=0.9")
        notify.wait()
    (warning,) = [r.getMessage() for r in caplog.records if "notify:" in r.getMessage()]
    assert f"({why}), as on a compute node without outbound network access" in warning
    assert SECRET not in warning


@pytest.mark.slow  # waits on its timeout (the quick tier waits on no timer)
def test_a_webhook_that_hangs_costs_the_timeout_at_most_and_one_warning(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    hanging = Webhook(delay_s=10)
    monkeypatch.setenv("HPCTRAIN_NOTIFY_URL", hanging.url)
    notify.configure(Notify(timeout_s=0.5), fresh)
    try:
        with caplog.at_level(logging.WARNING, logger="hpctrain"):
            started = time.monotonic()
            notify.post(notify.COMPLETED, "val/acc=0.9")
            notify.wait()
            waited = time.monotonic() - started
            time.sleep(0.3)  # the post's own timeout, just after: no second warning
    finally:
        hanging.close()
    assert waited < 1.5
    (warning,) = [r.getMessage() for r in caplog.records if "notify:" in r.getMessage()]
    assert "did not answer within notify.timeout_s=0.5" in warning


def test_trackers_get_the_code_a_run_recorded_first_and_the_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    for name, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_ARRAY_JOB_ID": "4240",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_GPUS_ON_NODE": "4",
    }.items():
        monkeypatch.setenv(name, value)
    git = {"commit": "abc123", "dirty": True, "diff_sha256": "d1ff", "snapshot": "/p/logs/snapshots/5e1f0c0d"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"git": git}))
    import hpctrain

    assert job_metadata(tmp_path) == {
        "slurm_job_id": "4242",
        "slurm_array_job_id": "4240",
        "slurm_array_task_id": "2",
        "allocation": {"nodes": "2", "tasks_per_node": "4", "gpus_on_node": "4"},
        "git_commit": "abc123",
        "git_dirty": True,
        "code_snapshot": "5e1f0c0d",
        "code_diff_sha256": "d1ff",
        "hpctrain_version": hpctrain.__version__,
    }


def test_a_sweeps_headline_counts_its_jobs_and_names_the_best():
    table = [
        {"job": 0, "status": "completed", "value": 0.91, "overrides": "lr=0.1"},
        {"job": 1, "status": "failed", "value": "", "overrides": "lr=-1"},
        {"job": 2, "status": "completed", "value": 0.95, "overrides": "lr=0.01"},
    ]
    summary = Summary(table, [], "val/acc", [Path("/s/summary.csv")])
    assert summary.headline("max") == (
        "3 jobs (2 completed, 1 failed); best val/acc=0.95 (job 2: lr=0.01); summary: /s/summary.csv"
    )
    assert summary.headline("min").startswith("3 jobs (2 completed, 1 failed); best val/acc=0.91 (job 0")


# ------------------------------------------------------------------------------ slow: real processes

SLURM_ARRAY_TASK = {  # a one-task batch job of an array, as `sbatch --array` runs it: one process
    "SLURM_JOB_ID": "4242",
    "SLURM_ARRAY_JOB_ID": "4240",
    "SLURM_ARRAY_TASK_ID": "2",
    "SLURM_NTASKS": "1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NTASKS_PER_NODE": "1",
}


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Webhook, Path, str]]:
    """One short run as a Slurm array task, with a webhook and csv, TensorBoard and MLflow loggers."""
    require_modules("tensorboard", "mlflow", install="pip install -e '.[tensorboard,mlflow]'")
    hook = Webhook()
    log_dir = tmp_path_factory.mktemp("slurm_run")
    result = train(log_dir, *QUICK, "logger=[many,mlflow]", env={**hook.env(), **SLURM_ARRAY_TASK})
    assert_ok(result)
    (run,) = run_dirs(log_dir)
    yield hook, run, result.stdout
    hook.close()


@pytest.mark.slow
def test_a_completed_run_posts_its_metric_once_and_writes_the_url_nowhere(slurm_run):
    hook, run, output = slurm_run
    value = yaml.safe_load((run / "outcome.yaml").read_text())["value"]
    (text,) = hook.texts
    assert text.startswith(f"hpctrain: run completed: val/acc={value:.4g} (best), test/acc=")
    assert f"\nrun dir: {run}\nSlurm job: 4240_2\nhost: " in text
    assert files_holding(run, SECRET) == [] and SECRET not in output
    assert not warnings_in(output)


@pytest.mark.slow
def test_every_tracker_gets_the_slurm_job_the_allocation_the_code_and_hpctrains_version(slurm_run):
    import hpctrain

    _, run, _ = slurm_run
    record = yaml.safe_load((run / "run.yaml").read_text())
    expected = {
        "slurm_job_id": "4242",
        "slurm_array_job_id": "4240",
        "slurm_array_task_id": "2",
        "allocation": {"nodes": "1", "tasks_per_node": "1"},
        "git_commit": record["git"]["commit"],
        "git_dirty": record["git"]["dirty"],
        "code_snapshot": None,
        "code_diff_sha256": None,
        "hpctrain_version": hpctrain.__version__,
    }
    for hparams in (run / "hparams.yaml", run / "tensorboard" / "hparams.yaml"):  # csv, TensorBoard
        assert yaml.safe_load(hparams.read_text())["job"] == expected, hparams

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run}/mlflow.db")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    params, tags = mlflow_run.data.params, mlflow_run.data.tags
    assert params["job/slurm_job_id"] == "4242" and params["job/allocation/tasks_per_node"] == "1"
    assert params["job/hpctrain_version"] == hpctrain.__version__
    assert tags["slurm_array_job_id"] == "4240" and tags["slurm_array_task_id"] == "2"
    assert tags["allocation.nodes"] == "1" and tags.get("git_dirty") == _tag(expected["git_dirty"])
    assert tags.get("git_commit") == tags.get("mlflow.source.git.commit") == expected["git_commit"]


def _tag(value: object) -> str | None:
    return None if value is None else str(value)


RAISING_MODULE = """
from myproject.models.classifier import ImageClassifier


class RaisingClassifier(ImageClassifier):
    '''The template's classifier, raising at step 2 on its last rank (a bug in the user's code).'''

    def training_step(self, batch, batch_idx):
        if self.global_step == 2 and self.global_rank == self.trainer.world_size - 1:
            raise RuntimeError("injected failure at step 2")
        return super().training_step(batch, batch_idx)
"""


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["cpu", "ddp_cpu"])
def test_a_crash_is_posted_once_with_its_one_line_error(tmp_path: Path, webhook: Webhook, trainer: str):
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "raising.py").write_text(textwrap.dedent(RAISING_MODULE))
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "raising.yaml").write_text("defaults: [mnist_cnn, _self_]\n_target_: raising.RaisingClassifier\n")
    result = train(
        tmp_path / "logs",
        f"--config-dir={tmp_path / 'conf'}",
        "model=raising",
        "data=digits",
        f"trainer={trainer}",
        "logger=csv",
        env={**webhook.env(), "PYTHONPATH": str(package)},
    )
    assert result.returncode == 1, result.stdout[-3000:]
    (text,) = webhook.texts  # under DDP: by rank 1, which failed, before rank 0 ends the job
    who = f"rank 1 on {os.uname().nodename} failed: " if trainer == "ddp_cpu" else ""
    assert text.startswith(f"hpctrain: run failed: {who}RuntimeError: injected failure at step 2\nrun dir: ")


@pytest.mark.slow
def test_a_refused_config_is_posted_to_the_webhook_its_notify_section_names(tmp_path: Path, webhook: Webhook):
    """The preflight's refusal of another key is posted where the config's own notify section says
    (here a variable of the user's), not only to the default one."""
    env = {"MY_WEBHOOK": webhook.url, "no_proxy": "*", "NO_PROXY": "*"}
    result = train(tmp_path, "experiment=quickstart", "notify.url_env=MY_WEBHOOK", "num_threads=-5", env=env)
    assert result.returncode == 2, result.stdout[-3000:]
    (text,) = webhook.texts
    assert text.startswith("hpctrain: run failed: num_threads=-5 is not a positive integer or auto"), text


@pytest.mark.slow
def test_a_nan_stop_posts_its_sentence_once(tmp_path: Path, webhook: Webhook):
    from tests.differential.cases import user_overrides

    result = train(
        tmp_path,
        *user_overrides("NaNAtStep"),
        "trainer=cpu",
        "trainer.max_epochs=2",
        "nan.check_every_n_steps=5",
        env={**webhook.env(), "PYTHONPATH": str(ROOT), "NAN_AT_STEP": "3"},
    )
    assert result.returncode == 2, result.stdout[-3000:]
    (text,) = webhook.texts
    assert text.startswith(
        "hpctrain: run stopped: the training loss is not finite: the training loss became nan at step 3 "
        "(epoch 0) on rank 0; the last good checkpoint is none"
    )


@pytest.mark.slow
def test_a_webhook_that_hangs_delays_the_end_by_notify_timeout_s_at_most(tmp_path: Path):
    hanging = Webhook(delay_s=60)
    try:
        result = train(tmp_path, *FAST, "notify.timeout_s=2", env=hanging.env())
        ended = time.monotonic()
    finally:
        hanging.close()
    assert_ok(result)
    ((posted, text),) = hanging.posts
    assert text.startswith("hpctrain: run completed: ")
    assert ended - posted < 2 + 2.5  # the timeout, and the interpreter's exit
    (warning,) = warnings_in(result.stdout)
    assert "the webhook did not answer within notify.timeout_s=2" in warning and SECRET not in warning


@pytest.mark.slow
def test_an_unreachable_webhook_is_one_warning_and_the_run_completes(tmp_path: Path):
    url = closed_port_url()
    result = train(tmp_path, *FAST, env={"HPCTRAIN_NOTIFY_URL": url, "no_proxy": "*", "NO_PROXY": "*"})
    assert_ok(result)
    (warning,) = warnings_in(result.stdout)
    assert "could not reach the webhook at 127.0.0.1:" in warning and "(connection refused)" in warning
    assert "compute node without outbound network access" in warning and SECRET not in result.stdout


@pytest.mark.slow
def test_the_url_is_refused_as_an_override_and_absent_from_help_and_the_config(tmp_path: Path):
    cache = tmp_path / "cache"
    env = {"HPCTRAIN_NOTIFY_URL": f"https://hooks.example.com/{SECRET}", "XDG_CACHE_HOME": str(cache)}
    for override in (f"notify.url=https://hooks.example.com/{SECRET}", "+notify.url=https://x.example/y"):
        refused = run_entry("train.py", f"paths.log_dir={tmp_path}", override, env=env)
        assert refused.returncode == 2 and refused.stdout.strip() == f"error: {notify_url_refused()}"
    for question in (["--help"], ["--cfg", "job"], ["--cfg", "job", "experiment=quickstart"]):
        answered = run_entry("train.py", *question, env=env)
        assert answered.returncode == 0 and SECRET not in answered.stdout, question
    assert "url_env: HPCTRAIN_NOTIFY_URL" in answered.stdout
    assert files_holding(cache, SECRET) == [] and any(cache.rglob("*"))  # the stored answers too
    assert not (tmp_path / "train").exists()


@pytest.mark.slow
def test_a_sweep_posts_its_summary_and_its_points_post_nothing(tmp_path: Path, webhook: Webhook):
    result = train(tmp_path, "-m", *QUICK, "test=false", "model.optimizer.lr=0.003,-1", env=webhook.env())
    assert_ok(result)
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    (text,) = webhook.texts
    assert text.startswith("hpctrain: sweep ended: 2 jobs (1 completed, 1 failed); best val/acc=")
    assert f"(job 0: model.optimizer.lr=0.003); summary: {sweep}/summary.csv\nsweep dir: {sweep}\n" in text
