"""Shared test helpers: run the entry points as real processes, read what a run left behind,
and write datasets in torchvision's raw MNIST format (no download needed)."""

from __future__ import annotations

import ast
import csv
import functools
import os
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# A project generated without the examples (copier's `examples` question) has no MNIST, CIFAR-10 or text
# data and no example models; the few tests with a case for them leave it out there.
EXAMPLES = (ROOT / "conf" / "data" / "mnist.yaml").is_file()


LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def require(missing: str | None, install: str) -> None:
    """A test's optional prerequisite (an extra, a system tool): where it is missing (`missing` says what
    is), skip with the reason and the install command; under CI=true, which installs everything, fail."""
    if missing is None:
        return
    import pytest

    reason = f"{missing} is not installed: {install}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true requires every optional prerequisite, but {reason}", pytrace=False)
    pytest.skip(reason)


def require_modules(*names: str, install: str = "pip install -e '.[export]'") -> None:
    import importlib.util

    missing = [name for name in names if importlib.util.find_spec(name) is None]
    require(", ".join(missing) or None, install)


def require_programs(*names: str, install: str) -> None:
    import shutil

    missing = [name for name in names if shutil.which(name) is None]
    require(", ".join(missing) or None, install)


def parsed(source: str) -> ast.Module:
    """`ast.parse(source)`, parsed once more after CPython 3.11's spurious "AST constructor recursion depth
    mismatch" SystemError (python/cpython#106905: the AST converter's depth counter is shared by the
    interpreter's threads, so a conversion in another thread can upset it; a second parse does not repeat
    it). Seen once, in the quick tier run inside a clone."""
    try:
        return ast.parse(source)
    except SystemError as err:
        if "recursion depth mismatch" not in str(err):
            raise
        return ast.parse(source)


def local_env() -> dict[str, str]:
    """This environment without any launcher's variables, as on a laptop."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in LAUNCH_VARS
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a run aborted on a test's timeout writes where each thread was
    return env


def run_script(
    path: str,
    *args: str,
    cwd: Path = ROOT,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python <path relative to the project> args...` as on a laptop; stdout+stderr in .stdout.

    The process is forked from an interpreter that has imported torch and Lightning already
    (tests/preload.py); `fresh=True` starts a new interpreter, for a test about the start itself."""
    from tests import preload

    env = {**local_env(), **(env or {})}
    return preload.run(ROOT / path, list(args), cwd=cwd, env=env, timeout=timeout, fresh=fresh)


def run_entry(script: str, *overrides: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run `python src/<script> overrides...` and return the finished process (stdout+stderr in .stdout);
    keyword arguments as for run_script."""
    return run_script(f"src/{script}", *overrides, **kwargs)


def train(log_dir: Path, *overrides: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """Train with every output under `log_dir` and quiet defaults suited to tests."""
    flags = [o for o in overrides if o.startswith("-")]  # e.g. -m, which argparse wants before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return run_entry(
        "train.py", *flags, f"paths.log_dir={log_dir}", "extras.print_config=false", *rest, **kwargs
    )


@functools.cache
def submit_script() -> types.ModuleType:
    """scripts/submit.py as a module, loaded once per test worker (it keeps no state between calls)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("submit", ROOT / "scripts" / "submit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def submit_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`python scripts/submit.py args...` run by its `main` in this process: its exit status (argparse's
    too) and what it printed. For what runs nothing (`--dry-run`, `--help`), so that a quick test starts no
    interpreter; the Slurm tests submit with the script itself."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = submit_script().main(list(args))
        except SystemExit as exit:  # argparse: --help, or a bad flag
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    return subprocess.CompletedProcess(["scripts/submit.py", *args], code, out.getvalue(), err.getvalue())


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-6000:]}"


def run_dirs(log_dir: Path, task: str = "train") -> list[Path]:
    return sorted(p for p in (log_dir / task / "runs").iterdir() if p.is_dir())


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


TIMING_PREFIXES = ("ranks/", "nodes/", "perf/", "gpus/")  # straggler report, callbacks.performance


def metrics_without_timing(run_dir: Path) -> list[dict[str, str]]:
    """metrics.csv without what wall-clock time decides: the speed column, the per-rank step times the
    straggler report logs every `diagnostics.straggler_every_s` seconds (at whichever step that falls
    on), and callbacks.performance's figures. Rows left with nothing but their step and epoch are dropped. Everything else must be equal
    between two runs of the same command, interrupted or not."""
    rows = []
    for row in read_metrics(run_dir):
        kept = {
            k: v for k, v in row.items() if k != "train/samples_per_s" and not k.startswith(TIMING_PREFIXES)
        }
        if any(v for k, v in kept.items() if k not in ("step", "epoch")):
            rows.append(kept)
    return rows


def last_value(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    assert values, f"{key} never logged"
    return values[-1]


def compose_train(output_dir: Path, data_dir: Path, *overrides: str):
    """The train config as `python src/train.py` would compose it, with outputs and data in test dirs."""
    from hpctrain.runtime.config.compose import compose

    paths = [f"paths.output_dir={output_dir}", f"paths.log_dir={output_dir}", f"paths.data_dir={data_dir}"]
    return compose("train", [*paths, *overrides])


@functools.cache
def composed(config_name: str, *overrides: str):
    """The config `python src/<config_name>.py <overrides>` would run with, composed once per test worker and
    shared by the tests that only read it (a composition costs about 0.1 s of CPU, and the quick tier asks
    some of the same ones many times). Read-only, so that no test changes what another reads: a test that
    changes its config, or conf/, composes its own (`compose`, `compose_train`)."""
    from omegaconf import OmegaConf

    from hpctrain.runtime.config.compose import compose

    cfg = compose(config_name, list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _idx_images(images: np.ndarray) -> bytes:
    n, rows, cols = images.shape
    return struct.pack(">IIII", 0x00000803, n, rows, cols) + images.astype(np.uint8).tobytes()


def _idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", 0x00000801, len(labels)) + labels.astype(np.uint8).tobytes()


def write_mnist_raw(
    data_dir: Path, name: str = "MNIST", train_size: int = 5600, test_size: int = 200
) -> Path:
    """Write the four raw idx files torchvision's MNIST/FashionMNIST read, with real handwritten digits
    (scikit-learn's, laid out 28x28 like MNIST) so that models can learn from them."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    repeats = -(-(train_size + test_size) // len(digits.images))  # the 1,797 digits, repeated as needed
    small = np.tile(digits.images / 16.0, (repeats, 1, 1))
    targets = np.tile(digits.target, repeats)
    # nearest-neighbour 8x8 -> 24x24, centred in 28x28
    big = np.zeros((len(small), 28, 28))
    big[:, 2:26, 2:26] = small.repeat(3, axis=1).repeat(3, axis=2)
    images = (big * 255).round().astype(np.uint8)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(images))
    train_idx = order[:train_size]
    test_idx = order[train_size : train_size + test_size]
    raw = data_dir / name / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "train-images-idx3-ubyte").write_bytes(_idx_images(images[train_idx]))
    (raw / "train-labels-idx1-ubyte").write_bytes(_idx_labels(targets[train_idx]))
    (raw / "t10k-images-idx3-ubyte").write_bytes(_idx_images(images[test_idx]))
    (raw / "t10k-labels-idx1-ubyte").write_bytes(_idx_labels(targets[test_idx]))
    return raw


def write_cifar10_batches(data_dir: Path, per_batch: int = 1100, test_size: int = 200) -> Path:
    """Write CIFAR-10's python-pickle batches (data_batch_1..5, test_batch, batches.meta) with images a
    model can learn from: each class a colour and a stripe orientation, plus noise."""
    import pickle

    rng = np.random.default_rng(0)
    folder = data_dir / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def batch(n: int, label: str) -> dict:
        labels = rng.integers(0, 10, n)
        colours = np.array([[i * 25, 255 - i * 25, (i * 70) % 255] for i in range(10)], dtype=np.float64)
        images = np.empty((n, 3, 32, 32))
        for k, cls in enumerate(labels):
            period = 2 + cls % 4
            rows, cols = np.arange(32)[:, None], np.arange(32)[None, :]
            pattern = (
                (rows // period % 2) * np.ones((1, 32))
                if cls < 5
                else (cols // period % 2) * np.ones((32, 1))
            )
            images[k] = colours[cls][:, None, None] * (0.5 + 0.5 * pattern)[None]
        images += rng.normal(0, 20, images.shape)
        data = np.clip(images, 0, 255).astype(np.uint8).reshape(n, -1)
        return {
            b"batch_label": label.encode(),
            b"labels": labels.tolist(),
            b"data": data,
            b"filenames": [b"x.png"] * n,
        }

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(per_batch, f"training batch {i} of 5")))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(test_size, "testing batch 1 of 1")))
    names = [
        b"airplane",
        b"automobile",
        b"bird",
        b"cat",
        b"deer",
        b"dog",
        b"frog",
        b"horse",
        b"ship",
        b"truck",
    ]
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": names, b"num_vis": 3072}))
    return folder


def write_image_folder(root: Path, per_split: int | None = None) -> Path:
    from myproject.data.digits import write_image_folder as write

    return write(root, per_split)


# What data=image_folder and data=shards need besides a root: the digits' classes and shape.
IMAGE_DATA = ("data.num_classes=10", "data.image_shape=[1,28,28]")


def write_small_image_data(data_dir: Path) -> None:
    """<data_dir>/digits_images (the first 80, 60 and 60 digits of each split as files) and its shards in
    <data_dir>/digits_shards, made in this process (the converter's own function)."""
    from hpctrain.data.files import ImageFolderDataModule
    from hpctrain.data.shards import make_shards as convert

    folder = write_image_folder(data_dir / "digits_images", per_split=80)
    images = ImageFolderDataModule(root=str(folder), num_classes=10, image_shape=(1, 28, 28))
    images.check_available()
    convert(images, data_dir / "digits_shards", shard_mb=0.01)


def make_shards(folder: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python scripts/make_shards.py data=image_folder data.root=<folder> --out <out>` for 28x28 digits."""
    overrides = (f"data.root={folder}", *IMAGE_DATA)
    return run_script(
        "scripts/make_shards.py", "data=image_folder", *overrides, "--out", str(out), *args, timeout=300
    )
