"""Bad input, table-driven, as real processes: every case exits non-zero within seconds with one
sentence that names the bad value and the fix (never a traceback as the only message), and leaves
every file that already existed in the log dir (run dirs, checkpoints, metrics) exactly as it was."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests import hostile
from tests.helpers import (
    EXAMPLES,
    PYTHON,
    ROOT,
    assert_ok,
    local_env,
    run_dirs,
    run_entry,
    train,
    write_mnist_raw,
)

pytestmark = pytest.mark.slow

DIGITS = ("data=digits", "trainer=cpu")


@dataclass
class Case:
    overrides: tuple[str, ...]
    says: tuple[str, ...]  # fragments of the one `error:` sentence
    entry: str = "train.py"
    env: dict[str, str] = field(default_factory=dict)
    command: tuple[str, ...] = ()  # a launcher in front of the entry point (torchrun)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A log dir holding one finished run (config, metrics, checkpoints), and the bad files the cases use."""
    root = tmp_path_factory.mktemp("bad_input")
    logs = root / "logs"
    assert_ok(train(logs, *DIGITS, "trainer.max_epochs=1", "trainer.limit_train_batches=3"))
    (run,) = run_dirs(logs)
    last = run / "checkpoints" / "last.ckpt"
    files: dict[str, Path] = {"logs": logs, "run": run, "last": last}

    files["truncated"] = root / "truncated.ckpt"
    files["truncated"].write_bytes(last.read_bytes()[:4000])
    files["random"] = root / "random.ckpt"
    files["random"].write_bytes(os.urandom(50_000))
    files["pickled"] = root / "pickled.ckpt"
    torch.save({"state_dict": {}, "loops": {}, "extra": Path("/code/runs/here")}, files["pickled"])
    mlp_logs = root / "mlp_logs"
    assert_ok(train(mlp_logs, *DIGITS, "model=mlp", "trainer.max_epochs=1", "trainer.limit_train_batches=2"))
    files["other_model"] = run_dirs(mlp_logs)[0] / "checkpoints" / "last.ckpt"

    files["list_run"] = root / "list_run"  # a run dir whose run.yaml is a YAML list
    files["list_run"].mkdir()
    (files["list_run"] / "run.yaml").write_text("- started\n- finished\n")
    files["empty_index"] = root / "empty_index.ckpt"  # a checkpoint folder whose index is {}
    files["empty_index"].mkdir()
    (files["empty_index"] / ".metadata").write_bytes(pickle.dumps({}))
    files["list_shards"] = hostile.index_folder(root / "list_shards.ckpt", "__0_0.distcp")
    (files["list_shards"] / "__0_0.distcp").write_bytes(b"\0" * 8)
    (files["list_shards"] / "shards.json").write_text("[]")  # a shard record that is a list
    files["outside_shard"] = hostile.index_folder(root / "outside.ckpt", "../truncated.ckpt")

    for name in ("mnist_data", "truncated_data", "corrupt_data", "empty_data", "unreadable_data"):
        files[name] = root / name
    write_mnist_raw(files["mnist_data"], "MNIST")
    write_mnist_raw(files["truncated_data"], "MNIST")
    images = files["truncated_data"] / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:5000])
    write_mnist_raw(files["corrupt_data"], "MNIST")
    (files["corrupt_data"] / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").write_bytes(os.urandom(3000))
    files["empty_data"].mkdir()
    write_mnist_raw(files["unreadable_data"], "MNIST")
    raw = files["unreadable_data"] / "MNIST" / "raw"
    if os.geteuid() == 0:  # root reads any file; a file where the directory should be cannot be read either
        shutil.rmtree(raw)
        raw.write_text("not a directory")
    else:
        raw.chmod(0)
    return files


def cases(w: dict[str, Path]) -> dict[str, Case]:
    run = w["run"]
    return dataset_cases(w) | {
        "unknown key": Case(
            ("trainer.max_epoch=3",), ("trainer.max_epoch is not a config key", "trainer.max_epochs=3")
        ),
        "unknown group option": Case(
            ("model=does_not_exist",), ("model=does_not_exist is not an option", "mnist_cnn")
        ),
        "misspelt option": Case(
            ("model/net=mlpp",), ("model/net=mlpp is not an option", "did you mean model/net=mlp?")
        ),
        "misspelt option in a list": Case(
            ("callbacks=[default,progres]",),
            ("callbacks=progres is not an option", "throughput", "did you mean callbacks=progress?"),
        ),
        "unknown group": Case(("modle=mlp",), ("modle is not a config key", "did you mean model=mlp?")),
        "unparseable override": Case(("trainer.devices=[1,",), ("cannot parse 'trainer.devices=[1,'",)),
        "key space value": Case(("trainer.devices", "2"), ("key=value", "write trainer.devices=2.")),
        "new key without +": Case(
            ("callbacks.swa._target_=pytorch_lightning.callbacks.StochasticWeightAveraging",),
            ("to add it as a new key write +callbacks.swa._target_=pytorch_lightning.callbacks.Stoch",),
        ),
        "misspelt target": Case(
            ("model._target_=myproject.models.clasifier.ImageClassifier",),
            ("did you mean myproject.models.classifier.ImageClassifier?",),
        ),
        "wrong type": Case(
            ("trainer.max_epochs=ten",), ("trainer.max_epochs='ten' is not an integer", "max_epochs=10")
        ),
        "wrong type, bool": Case(("test=maybe",), ("test='maybe' is not true or false",)),
        "num_nodes 0": Case(("trainer.num_nodes=0",), ("trainer.num_nodes=0 is not a positive integer",)),
        "num_nodes negative": Case(
            ("trainer.num_nodes=-2",), ("trainer.num_nodes=-2 is not a positive integer",)
        ),
        "devices 0": Case(("trainer.devices=0",), ("trainer.devices=0 is not a positive integer",)),
        "more devices than GPUs": Case(
            ("trainer=gpu", "trainer.devices=2"),
            ("trainer.devices=2 but this process sees only 1 GPU(s)",),
            env={"CUDA_VISIBLE_DEVICES": "0"},
        ),
        "GPU trainer without GPUs": Case(
            ("trainer=gpu",), ("sees no GPU", "trainer=ddp_cpu"), env={"CUDA_VISIBLE_DEVICES": ""}
        ),
        "batch_size 0": Case(("data.batch_size=0",), ("data.batch_size=0 is not a positive integer",)),
        "batch_size negative": Case(
            ("data.batch_size=-4",), ("data.batch_size=-4 is not a positive integer",)
        ),
        "lr 0": Case(("model.optimizer.lr=0",), ("model.optimizer.lr=0 is not a positive number",)),
        "lr negative": Case(
            ("model.optimizer.lr=-0.1",), ("model.optimizer.lr=-0.1 is not a positive number",)
        ),
        "negative max_epochs": Case(
            ("trainer.max_epochs=-3",), ("trainer.max_epochs=-3 is not an integer, -1 or more",)
        ),
        "unknown precision": Case(
            ("trainer.precision=8-mixed",), ("trainer.precision='8-mixed' is not one of",)
        ),
        "precision not supported here": Case(
            ("trainer=cpu", "trainer.precision=16-mixed"),
            ("trainer.precision=16-mixed needs a GPU", "bf16-mixed"),
        ),
        "unknown monitor mode": Case(
            ("monitor.mode=maximum",), ("monitor.mode='maximum' is not min or max",)
        ),
        "no monitored metric in a sweep": Case(
            ("hydra.mode=MULTIRUN", "seed=1,2", "monitor.metric=null"),
            ("monitor.metric=null, but a sweep compares its points by the monitored metric",),
        ),
        "unknown signal": Case(("requeue.signal=SIGFOO",), ("requeue.signal='SIGFOO' is not a signal name",)),
        "zero timeout": Case(
            ("dist.timeout_min=0",), ("dist.timeout_min=0 is not a positive finite number of minutes",)
        ),
        "dangling interpolation": Case(
            ("model.num_classes=${data.n_classes}",),
            ("model.num_classes cannot be resolved", "data.n_classes"),
        ),
        "secret in the config": Case(
            ("logger=wandb", "+logger.wandb.api_key=abc123"),
            ("logger.wandb.api_key is set in the config", "WANDB_API_KEY"),
        ),
        "missing checkpoint": Case(
            ("ckpt_path=/nonexistent/x.ckpt",), ("ckpt_path=/nonexistent/x.ckpt does not exist",)
        ),
        "ckpt_path=last without runs": Case(
            ("ckpt_path=last", "task_name=nothing_yet"), ("ckpt_path=last but no earlier run",)
        ),
        "truncated checkpoint": Case(
            (f"ckpt_path={w['truncated']}",), (f"ckpt_path={w['truncated']} is not a readable checkpoint",)
        ),
        "random-bytes checkpoint": Case(
            (f"ckpt_path={w['random']}",), (f"ckpt_path={w['random']} is not a readable checkpoint",)
        ),
        "checkpoint with pickled code": Case(
            (f"ckpt_path={w['pickled']}",), ("holds pickled Python objects", "weights_only=True")
        ),
        "checkpoint of another model": Case(
            (f"ckpt_path={w['other_model']}",), ("holds the weights of a different model", "layers.")
        ),
        "eval: checkpoint of another model": Case(
            (f"ckpt_path={w['other_model']}", "model=mnist_cnn"),
            ("holds the weights of a different model",),
            entry="eval.py",
        ),
        "eval: truncated checkpoint": Case(
            (f"ckpt_path={w['truncated']}",), ("is not a readable checkpoint",), entry="eval.py"
        ),
        "eval: no checkpoint": Case((), ("ckpt_path is required",), entry="eval.py"),
        "run dir of another run": Case(
            (f"hydra.run.dir={run}",), ("this run dir already holds checkpoints of another run",)
        ),
        "ckpt_path conflicting with the run dir": Case(
            (f"hydra.run.dir={run}", f"ckpt_path={w['other_model']}"),
            ("conflicts with the checkpoints of another run",),
        ),
        "run dir not writable": Case(
            ("hydra.run.dir=/proc/not-here",), ("/proc/not-here", "directory you can write")
        ),
        "torchrun processes vs devices": Case(
            ("trainer=ddp_cpu",),
            ("trainer.devices=2 but torchrun starts 1 processes per node (--nproc-per-node=1)",),
            command=(PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"),
        ),
        "plain python on several nodes": Case(
            ("trainer.num_nodes=2",), ("trainer.num_nodes=2 needs a launcher",)
        ),
        "infinite timeout": Case(
            ("dist.timeout_min=inf",), ("dist.timeout_min=inf is not a positive finite number of minutes",)
        ),
        "infinite notify timeout": Case(
            ("notify.timeout_s=inf",), ("notify.timeout_s=inf is not a positive finite number of seconds",)
        ),
        "seed beyond 32 bits": Case(("seed=4294967296",), ("seed=4294967296 is not an integer from 0 to",)),
        "exclude not a regular expression": Case(
            ("init_from.exclude=['[']",), ("init_from.exclude holds '[', which is not a regular expression",)
        ),
        "freeze not a regular expression": Case(
            ("init_from.freeze=['(']",), ("init_from.freeze holds '(', which is not a regular expression",)
        ),
        "exclude without brackets": Case(
            ("init_from.exclude=head",), ("init_from.exclude='head' is not a list of regular expressions",)
        ),
        "a group set to null": Case(("logger=null",), ("logger=null names no option", "~logger")),
        "the webhook URL as a job's environment": Case(
            ("hydra.job.env_set.HPCTRAIN_NOTIFY_URL=https://hooks.example.com/T0/B0/x",),
            ("hydra.job.env_set.HPCTRAIN_NOTIFY_URL holds the webhook URL",),
        ),
        "run.yaml that is a list": Case(
            (f"hydra.run.dir={w['list_run']}",), ("run.yaml is not a run's record (it holds a list",)
        ),
        "index holding {}": Case(
            (f"ckpt_path={w['empty_index']}",),
            ("that is not a checkpoint's (it holds a dict)",),
            entry="eval.py",
        ),
        "shards.json holding []": Case(
            (f"ckpt_path={w['list_shards']}",),
            ("its shards.json is not a record of shard files",),
            entry="eval.py",
        ),
        "shard outside its folder": Case(
            (f"init_from.path={w['outside_shard']}",), ("which lies outside the checkpoint folder",)
        ),
    }


def dataset_cases(w: dict[str, Path]) -> dict[str, Case]:
    """Bad dataset files (MNIST's, from the examples)."""
    if not EXAMPLES:
        return {}
    mnist = ("data=mnist", "data.download=false", "trainer=cpu")
    return {
        "missing dataset offline": Case(
            (*mnist, f"paths.data_dir={w['empty_data']}"),
            ("MNIST is not in", "scripts/prepare_data.py data=mnist"),
        ),
        "truncated dataset": Case(
            (*mnist, f"paths.data_dir={w['truncated_data']}"),
            ("missing, corrupt or truncated", "prepare_data.py"),
        ),
        "corrupt dataset": Case(
            (*mnist, f"paths.data_dir={w['corrupt_data']}"), ("missing, corrupt or truncated",)
        ),
        "unreadable data dir": Case(
            (*mnist, f"paths.data_dir={w['unreadable_data']}"), ("MNIST", "paths.data_dir")
        ),
        "val_size too large": Case(
            (*mnist, f"paths.data_dir={w['mnist_data']}", "data.val_size=999999"),
            ("data.val_size=999999 must be between 0 and the 5600 training images",),
        ),
    }


def _snapshot(directory: Path) -> dict[str, tuple[str, float]]:
    return {
        str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime)
        for p in directory.rglob("*")
        if p.is_file()
    }


CASE_NAMES = list(cases(defaultdict(lambda: Path("/x"))))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_sentence_and_changes_nothing(world: dict[str, Path], name: str):
    case = cases(world)[name]
    before = _snapshot(world["logs"])
    started = time.monotonic()
    overrides = (f"paths.log_dir={world['logs']}", "extras.print_config=false", *DIGITS, *case.overrides)
    if case.command:
        result = subprocess.run(
            [*case.command, str(ROOT / "src" / case.entry), *overrides],
            cwd=ROOT,
            env={**local_env(), **case.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
    else:
        result = run_entry(case.entry, *overrides, env=case.env, timeout=120)
    elapsed = time.monotonic() - started
    output = result.stdout
    assert result.returncode == (2 if not case.command else result.returncode) != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(set(errors)) == 1, output[-3000:]  # one sentence (each process of a launcher may say it)
    for fragment in case.says:
        assert fragment in errors[0], errors[0]
    if not case.command:  # (torchrun, a launcher, prints its own report of a worker's exit status)
        assert "Traceback" not in output, output[-3000:]
    assert elapsed < 45, f"took {elapsed:.0f} s"
    after = _snapshot(world["logs"])
    assert {path: after.get(path) for path in before} == before  # nothing that existed was touched


def test_the_table_covers_forty_cases():
    assert len(CASE_NAMES) >= 40


SUBMIT_CASES = {  # scripts/submit.py, which checks a request before sbatch sees it
    "memory sbatch does not take": (
        ["--sweep", "--pack", "2", "--mem", "1.5G", "--dry-run", "--", "seed=1,2"],
        "1.5G is not a memory size sbatch takes",
    ),
    "a grid that does not parse": (
        ["--sweep", "--dry-run", "--", "model.optimizer.lr=[0.1,"],
        "cannot parse",
    ),
    "sinfo failing": (
        ["--no-snapshot", "--", "experiment=quickstart"],
        "sinfo, which says what the partition",
    ),
}


@pytest.mark.parametrize("name", SUBMIT_CASES)
def test_submit_bad_input_is_one_sentence(name: str, tmp_path: Path):
    argv, says = SUBMIT_CASES[name]
    tools = tmp_path / "bin"  # a login node whose SLURM does not answer
    tools.mkdir()
    for tool, body in (
        ("sinfo", "echo 'sinfo: error: Unable to contact slurm controller' >&2; exit 1"),
        ("sbatch", "exit 0"),
    ):
        (tools / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tools / tool).chmod(0o755)
    env = {**local_env(), "PATH": f"{tools}:{os.environ['PATH']}"}
    result = subprocess.run(
        [PYTHON, str(ROOT / "scripts" / "submit.py"), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stdout.splitlines() if "error: " in line]
    assert result.returncode == 2 and len(errors) == 1 and says in errors[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
