"""A received run folder, every file of it hostile at once (tests/hostile.py: `received_run_folder`),
through every entry point and script that reads a run dir, each once: `hpctrain.load` (its sharded
checkpoint's index swapped after the first read), consolidate, eval, predict, export, plot, summarize,
doctor, stacks, and train resumed in place. Whatever each does (a refusal or a completed run):

- no code runs: the marker file the hostile files try to leave is absent;
- nothing outside the received folder changes (every file beside it, the victims the folder names
  included, compared before and after; each command's own run dir aside), and no process of the user's
  is signalled;
- no secret appears in any output: the secret is in this machine's environment, and the folder's strings
  would read it if anything resolved them;
- each refusal is one sentence (`error: ...`, exit status 2, no traceback).

A second test gives the folder links that lead out of it (its metrics.csv, a stack file, the training
log): every command that writes into a run dir refuses it before writing.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import types
from pathlib import Path

import pytest

import hpctrain
from hpctrain.runtime.config import targets
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import sharded
from tests import hostile
from tests.helpers import require_modules, run_dirs, run_entry, run_script

SECRET = "s3cret-7e1d-not-for-output"
SECRET_ENV = {hostile.SECRET_ENV: SECRET}


def _holder() -> str:
    """A module of the project's package that imports torch (the walk goes through it)."""
    import importlib
    import pkgutil

    for package in targets.project_packages():
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            module = importlib.import_module(info.name)
            if isinstance(vars(module).get("torch"), types.ModuleType):
                return info.name
    raise AssertionError("no module of the project's package imports torch")


def _files(root: Path, skip: tuple[Path, ...]) -> dict[str, tuple[int, str]]:
    """Every file (and link) under `root` but those under `skip`: size and digest, to compare."""
    found = {}
    for path in sorted(root.rglob("*")):
        if any(path == s or s in path.parents for s in skip) or (path.is_dir() and not path.is_symlink()):
            continue
        data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        found[str(path.relative_to(root))] = (len(data), hashlib.sha256(data).hexdigest())
    return found


class Place:
    """The test's world: the received folder (a sweep dir holding the run 0/), what lies outside it, the
    logs where each command writes its own run dir, the marker, a victim process of the user's."""

    def __init__(self, root: Path, trained: Path) -> None:
        self.root = root
        self.received = root / "received"
        self.outside = root / "outside"
        self.logs = root / "logs"
        self.marker = root / "code-ran"
        self.outside.mkdir()
        (self.outside / "victim.ckpt").write_bytes(b"the user's own checkpoint")
        (self.outside / "victim.csv").write_text("the user's own metrics\n")
        (self.outside / "victim.txt").write_text("the user's own notes\n")
        self.victim = subprocess.Popen(["sleep", "600"])  # a process of the user's on this machine
        self.run = hostile.received_run_folder(
            trained, self.received / "0", self.marker, self.outside, _holder(), self.victim.pid
        )
        self.before = self.outside_files()
        self.outputs: list[str] = []

    def outside_files(self) -> dict[str, tuple[int, str]]:
        return _files(self.root, skip=(self.received, self.logs))

    def command(self, result: subprocess.CompletedProcess[str], refused: str | None = None) -> str:
        """Check one command's result: its refusal (one sentence naming `refused`), or its success."""
        out = result.stdout
        self.outputs.append(out)
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        if refused is None:
            assert result.returncode == 0 and not errors, out[-4000:]
        else:
            assert result.returncode == 2 and len(errors) == 1 and refused in errors[0], out[-4000:]
        assert "Traceback" not in out, out[-4000:]
        return out

    def close(self) -> None:
        if self.victim.poll() is None:
            os.kill(self.victim.pid, signal.SIGKILL)
        self.victim.wait()


@pytest.fixture
def place(tmp_path: Path, trained_run: Path):
    """The session's trained run dir (tests/conftest.py), copied and made hostile."""
    found = Place(tmp_path, trained_run)
    yield found
    found.close()


def _in_process(place: Place) -> None:
    """hpctrain.load, in this process: the sharded folder's index swapped after its first read (the load
    reads it once and succeeds), then last.ckpt (refused: its network is a walk)."""
    folder = place.run / "checkpoints" / "sharded.ckpt"
    with hostile.SwappedAfterFirstRead(
        folder / sharded.INDEX_FILE, hostile.shell_pickle(place.marker)
    ) as swap:
        model = hpctrain.load(folder)
    assert swap.opens == 1 and model.config["model"]["_target_"].endswith("ImageClassifier")
    (folder / sharded.INDEX_FILE).write_bytes(hostile.shell_pickle(place.marker))  # swapped now, for good
    with pytest.raises(UserError) as refused:
        hpctrain.load(place.run / "checkpoints" / "last.ckpt")
    said = str(refused.value)
    assert (
        "was trained with model.net._target_=" in said and "which this project's configs do not give" in said
    )
    place.outputs.append(str(refused.value))


@pytest.mark.slow  # a trained run (shared) and ten commands, each once
def test_a_hostile_received_run_folder_runs_nothing_through_any_entry_point(
    place: Place, data_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    require_modules("safetensors")
    monkeypatch.setenv(hostile.SECRET_ENV, SECRET)  # hpctrain.load, in this process
    run, logs, env = place.run, place.logs, SECRET_ENV
    checkpoints = run / "checkpoints"
    common = (f"paths.log_dir={logs}", "extras.print_config=true")

    _in_process(place)
    # the index is hostile on disk now: consolidate reads it with the restricted unpickler
    place.command(
        run_script(
            "scripts/consolidate.py", str(checkpoints / "sharded.ckpt"), str(logs / "model.ckpt"), env=env
        ),
        refused="holds other Python objects",
    )
    place.command(
        run_entry("eval.py", *common, f"ckpt_path={checkpoints / 'last.ckpt'}", env=env, timeout=180),
        refused="was trained with model.net._target_=",
    )
    place.command(
        run_entry("predict.py", *common, f"ckpt_path={checkpoints / 'epoch_000.ckpt'}", env=env, timeout=180),
    )  # its monitor asks for the environment: not taken, the project's own stands
    place.command(
        run_entry(
            "export.py",
            *common,
            f"ckpt_path={checkpoints / 'epoch_000.ckpt'}",
            "export.format=safetensors",
            env=env,
            timeout=300,
        )
    )
    (exported,) = run_dirs(logs, task="export")
    card = (exported / "model_card.md").read_text()
    assert card.count("```python") == 1 and "not recorded" in card  # the folder's code blocks are text
    assert "import os" not in card.split("```python")[1].split("```")[0]
    place.command(run_script("scripts/plot.py", str(run), env=env))
    place.command(run_script("scripts/summarize.py", str(place.received), env=env))
    place.command(
        run_script(
            "scripts/doctor.py", f"paths.log_dir={place.received}", f"paths.data_dir={data_dir}", env=env
        )
    )
    stacks = place.command(run_script("scripts/stacks.py", str(run), "--wait", "0.5", env=env))
    assert "did not answer" in stacks and place.victim.poll() is None  # the victim was not signalled
    resumed = place.command(
        run_entry(
            "train.py",
            *common,
            "experiment=quickstart",
            f"hydra.run.dir={run}",
            f"ckpt_path={checkpoints / 'last.ckpt'}",
            "trainer.max_epochs=2",
            "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1",
            "test=false",
            env=env,
            timeout=300,
        )
    )
    assert (
        "state names" in resumed
        and "dropped, so nothing outside the run's checkpoints is read or removed" in resumed
    )

    assert not place.marker.exists(), "a hostile file ran code"
    assert place.outside_files() == place.before, "a file outside the received folder changed"
    assert place.victim.poll() is None
    written = [
        p for p in (*logs.rglob("*"), *place.received.rglob("*")) if p.is_file() and not p.is_symlink()
    ]
    holding = [str(p) for p in written if SECRET.encode() in p.read_bytes()]
    assert holding == [] and not any(SECRET in out for out in place.outputs), holding


@pytest.mark.slow  # four commands, refused before they write
def test_a_received_run_folder_with_links_out_of_it_is_refused_before_anything_is_written(place: Place):
    run = place.run
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to(place.outside / "victim.csv")
    (run / "stacks" / "rank0.txt").unlink()
    (run / "stacks" / "rank0.txt").symlink_to(place.outside / "victim.txt")
    (run / "train.log").unlink()
    (run / "train.log").symlink_to(place.outside / "train.log")  # would be created there
    (run / "curves.png").unlink()
    before = place.outside_files()
    says = "a link to"
    place.command(
        run_entry(
            "train.py",
            f"paths.log_dir={place.logs}",
            "experiment=quickstart",
            f"hydra.run.dir={run}",
            f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
            "trainer.max_epochs=2",
            timeout=180,
        ),
        refused=says,
    )
    place.command(run_script("scripts/plot.py", str(run)), refused=says)
    place.command(run_script("scripts/summarize.py", str(place.received)), refused=says)
    place.command(run_script("scripts/stacks.py", str(run), "--wait", "0.5"), refused=says)
    assert place.outside_files() == before and not (place.outside / "train.log").exists()
    assert not (run / "curves.png").exists() and not (place.received / "summary.csv").exists()
    assert place.victim.poll() is None and not place.marker.exists()
