"""Secrets stay out of records: a value read from the environment is recorded as its interpolation, a
URL's credentials and an environment variable set through Hydra are hidden, in every file a run writes
(config.yaml, .hydra/, run.yaml, outcome.yaml, checkpoints, tracker params, the log), and a code
snapshot leaves files that hold secrets behind."""

from __future__ import annotations

import random
import shutil
import string
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hpctrain.runtime import snapshot
from hpctrain.runtime.config import redact
from hpctrain.runtime.config.compose import PROJECT_ROOT
from hpctrain.runtime.storage import records
from tests.helpers import IMAGE_DATA, assert_ok, run_dirs, train

TOKEN = "tok-3f9a1c-not-for-files"
PASSWORD = "pw-77c2e-not-for-files"


def test_every_url_is_parsed_and_its_secret_parts_hidden():
    """By what a part of a URL is, not by its key's name: userinfo whole, query values but harmless keys,
    fragments, a webhook's path."""
    assert (
        redact.text(f"https://alice:{PASSWORD}@mlflow.example:5000/x") == "https://***@mlflow.example:5000/x"
    )
    assert (
        redact.text(f"see https://{TOKEN}@github.com/o/r.git now") == "see https://***@github.com/o/r.git now"
    )
    assert redact.text(f"postgresql://u:p%40{PASSWORD}@db/runs?sslmode=require") == (
        "postgresql://***@db/runs?sslmode=require"
    )
    assert redact.text(f"https://h.example/x?api_key={TOKEN}&n=1&timeout=30") == (
        "https://h.example/x?api_key=***&n=***&timeout=30"
    )
    assert (
        redact.text(f"https://h.example/x?q={TOKEN}#access_token={TOKEN}") == "https://h.example/x?q=***#***"
    )
    assert redact.text(f"https://hooks.slack.com/services/T0/B0/{TOKEN}") == "https://hooks.slack.com/***"
    assert redact.text(f"https://api.telegram.org/bot{TOKEN}/sendMessage") == "https://api.telegram.org/***"
    assert redact.text(f"https://chat.example/hooks/{TOKEN}") == "https://chat.example/***"
    assert redact.text("https://h.example/plain/path") == "https://h.example/plain/path"
    assert (
        redact.override(f"hydra.job.env_set.WANDB_API_KEY={TOKEN}") == "hydra.job.env_set.WANDB_API_KEY=***"
    )
    assert redact.override("model.optimizer.lr=0.1") == "model.optimizer.lr=0.1"


def test_no_userinfo_or_query_value_survives_whatever_characters_it_holds():
    """Generated: userinfo and query values of every printable character but the URL's own delimiters
    (the cases a pattern of key names and `user:password` missed: a token alone, `;`, `%40`, `:` twice)."""
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:%"
    for _ in range(600):
        secret = "S" + "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 24))) + "Z"
        userinfo_only = secret.replace("'", "")  # a quote ends a URL in text, as in a repr or YAML
        for written in (
            f"https://{userinfo_only}@host.example/p",
            f"https://u:{userinfo_only}@host.example:1/p?x=1",
            f"s3://bucket/key?X-Amz-Signature={secret.replace('&', '').replace(';', '').replace(chr(39), '')}",
        ):
            shown = redact.text(f"uri: {written} done")
            assert userinfo_only.replace("&", "").replace(";", "") not in shown, (written, shown)
            assert shown.startswith("uri: ") and shown.endswith(" done")


def test_an_error_sentence_printed_or_recorded_shows_no_secret_of_a_url(capsys: pytest.CaptureFixture[str]):
    from hpctrain.runtime.distributed.endings import ending
    from hpctrain.runtime.errors import UserError, reported_as_one_sentence

    err = UserError(f"logger.mlflow.tracking_uri=https://alice:{PASSWORD}@h.example/?token={TOKEN} is wrong")
    with pytest.raises(SystemExit), reported_as_one_sentence():
        raise err
    printed = capsys.readouterr().err
    assert printed.startswith("error: logger.mlflow.tracking_uri=https://***@h.example/?token=***")
    recorded = ending(err).detail or ""  # outcome.yaml's error, the webhook's message
    assert PASSWORD not in printed + recorded and TOKEN not in printed + recorded


def test_a_record_keeps_every_value_a_resolver_gives_as_written(monkeypatch: pytest.MonkeyPatch):
    """oc.env, oc.decode, a project's own resolver (reading a vault, say): recorded as written; only
    hpctrain's own path and name resolvers resolve."""
    from hpctrain.runtime.config.versions import register_resolver

    monkeypatch.setenv("HPCTRAIN_TEST_TOKEN", TOKEN)
    register_resolver("test_vault", lambda name: TOKEN)
    cfg = OmegaConf.create(
        {
            "token": "${oc.env:HPCTRAIN_TEST_TOKEN}",
            "header": "Bearer ${token}",  # depends on it: shows the interpolation, not the value
            "vault": "${test_vault:wandb}",
            "escaped": "\\\\${test_vault:wandb}",  # a backslash, then the resolver: as written too
            "uri": f"https://alice:{PASSWORD}@mlflow.example",
            "lr": "${oc.decode:'0.1'}",
            "root": "${project_root:}",
            "width": 8,
        }
    )
    recorded = redact.recorded(cfg)
    assert recorded == {
        "token": "${oc.env:HPCTRAIN_TEST_TOKEN}",
        "header": "Bearer ${oc.env:HPCTRAIN_TEST_TOKEN}",
        "vault": "${test_vault:wandb}",
        "escaped": "\\\\${test_vault:wandb}",
        "uri": "https://***@mlflow.example",
        "lr": "${oc.decode:'0.1'}",
        "root": str(PROJECT_ROOT.resolve()),
        "width": 8,
    }
    assert TOKEN not in repr(recorded) and TOKEN not in redact.yaml_text(cfg)


def test_a_record_resolves_hydras_run_dir_and_job_name_but_not_its_environment(
    monkeypatch: pytest.MonkeyPatch,
):
    """`${hydra:...}` of where and as what the job runs (paths.output_dir is one) is recorded resolved;
    the rest of Hydra's config (job.env_set holds API keys) as written."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import setup_globals

    setup_globals()  # Hydra's resolvers, `hydra` among them, as an app registers them
    hydra = OmegaConf.create(
        {"hydra": {"runtime": {"output_dir": "/runs/7"}, "job": {"name": "train", "env_set": {"KEY": TOKEN}}}}
    )
    monkeypatch.setattr(HydraConfig.instance(), "cfg", hydra)
    cfg = OmegaConf.create(
        {
            "output_dir": "${hydra:runtime.output_dir}",
            "name": "${hydra:job.name}",
            "key": "${hydra:job.env_set.KEY}",
            "keys": "${hydra:job.env_set}",
        }
    )
    recorded = redact.recorded(cfg)
    assert recorded == {
        "output_dir": "/runs/7",
        "name": "train",
        "key": "${hydra:job.env_set.KEY}",
        "keys": "${hydra:job.env_set}",
    }
    assert TOKEN not in redact.yaml_text(cfg)


def test_the_run_dir_records_hold_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HPCTRAIN_TEST_TOKEN", TOKEN)
    cfg = OmegaConf.create({"token": "${oc.env:HPCTRAIN_TEST_TOKEN}", "uri": f"https://a:{PASSWORD}@h"})
    hydra = OmegaConf.create(
        {
            "job": {"env_set": {"WANDB_API_KEY": TOKEN}},
            "overrides": {
                "task": [f"hydra.job.env_set.WANDB_API_KEY={TOKEN}", f"+uri=https://a:{PASSWORD}@h"]
            },
        }
    )
    overrides = [f"hydra.job.env_set.WANDB_API_KEY={TOKEN}", f"+uri=https://a:{PASSWORD}@h"]
    records.write_run_record(cfg, tmp_path, overrides, tmp_path, 1, hydra)
    (tmp_path / "run.yaml").touch()  # this run's dir: its outcome is recorded
    with records.outcome_recorded(tmp_path, None, overrides):
        (tmp_path / "run.yaml").write_text((tmp_path / "run.yaml").read_text() + "\n")
    written = {p.relative_to(tmp_path).as_posix(): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert {"config.yaml", "run.yaml", "outcome.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"} <= set(
        written
    )
    assert [name for name, text in written.items() if TOKEN in text or PASSWORD in text] == []
    assert "${oc.env:HPCTRAIN_TEST_TOKEN}" in written["config.yaml"]


def test_a_snapshot_leaves_files_that_hold_secrets_behind(tmp_path: Path):
    project = tmp_path / "project"
    (project / "conf" / "local").mkdir(parents=True)
    (project / "model.py").write_text("x = 1\n")
    (project / ".env").write_text(f"TOKEN={TOKEN}\n")
    (project / "conf" / "local" / "default.yaml").write_text("paths: {}\n")
    (project / "conf" / "local" / "prod.env").write_text(f"TOKEN={TOKEN}\n")
    (project / ".netrc").write_text(f"machine h password {PASSWORD}\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "add", ".netrc", "model.py"], check=True)  # tracked, even
    assert snapshot.code_files(project) == ["conf/local/default.yaml", "model.py"]


def test_a_value_the_environment_gave_is_scrubbed_from_kept_hyperparameters(monkeypatch: pytest.MonkeyPatch):
    """A class that keeps its arguments (save_hyperparameters) keeps the value: the checkpoint holds the
    interpolation in its place, and URLs' credentials hidden."""
    from hpctrain.runtime.storage.checkpoints.writing import AtomicCheckpointIO

    monkeypatch.setenv("HPCTRAIN_TEST_TOKEN", TOKEN)
    cfg = OmegaConf.create(
        {"model": {"token": "${oc.env:HPCTRAIN_TEST_TOKEN}", "n": "${oc.env:HPCTRAIN_TEST_TOKEN,4}"}}
    )
    writer = AtomicCheckpointIO(redact.environment_values(cfg))
    kept = writer._plain(
        {"hyper_parameters": {"token": TOKEN, "uri": f"https://a:{PASSWORD}@h", "n": 4}, "state_dict": {}}
    )
    assert kept["hyper_parameters"] == {
        "token": "${oc.env:HPCTRAIN_TEST_TOKEN}",
        "uri": "https://***@h",
        "n": 4,
    }


@pytest.mark.slow
def test_a_run_writes_no_secret_anywhere(tmp_path: Path, data_dir: Path):
    """A real run given a token through the environment (its data folder is named by it) and a URL with a
    password: no file under its run dir (checkpoints, .hydra, records) and no line of its log holds either."""
    root = tmp_path / TOKEN / "images"
    shutil.copytree(data_dir / "digits_images", root)
    result = train(
        tmp_path / "logs",
        "data=image_folder",
        *IMAGE_DATA,
        "data.root=${oc.env:HPCTRAIN_TEST_ROOT}",  # stored in every checkpoint (data): as written
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "test=false",
        "extras.print_config=true",
        f"tags=[quick,https://alice:{PASSWORD}@mlflow.example]",
        f"+hydra.job.env_set.WANDB_API_KEY={PASSWORD}",
        env={"HPCTRAIN_TEST_ROOT": str(root)},
    )
    assert_ok(result)
    assert TOKEN not in result.stdout and PASSWORD not in result.stdout  # the printed config, the log
    (run,) = run_dirs(tmp_path / "logs")
    secret = (TOKEN.encode(), PASSWORD.encode())
    holding = [p for p in run.rglob("*") if p.is_file() and any(s in p.read_bytes() for s in secret)]
    assert holding == []
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["root"] == "${oc.env:HPCTRAIN_TEST_ROOT}"
    assert (run / "checkpoints" / "last.ckpt").is_file()
