"""The template against a hand-written PyTorch loop, side by side in one run, plus startup costs.

    python scripts/dev/benchmark.py                          # mlp and mnist_cnn, 1 and 2 processes
    python scripts/dev/benchmark.py --tiny --json out.json   # seconds, for the test suite

Three ways train the same network with the same optimizer on the same in-memory data (the `random`
datamodule's tensors), batch size and number of samples:

  raw        a hand-written loop: DistributedSampler indices, one tensor index per batch, normalise,
             forward, backward, step; DistributedDataParallel when there is more than one process
  lightning  Lightning's bare loop over the same batches: no callbacks, metrics, logging or checkpoints
             (its gap to raw is Lightning's own per-step cost)
  template   this template's datamodule, ImageClassifier, Trainer and default callbacks, loggers off

All three run in turn inside one process (one per rank: torchrun starts two for world size 2, gloo
on CPU, nccl on GPU), several rounds, so the ratios compare runs taken side by side. A figure is
the median samples/s (all processes together) over the epochs after the first of each run. Also
measured, side by side: wall time of `python src/train.py --help` and of `--cfg job`, asked again
(the stored answer) and composed by Hydra (and the peak RSS), against `python -c "import hydra"`, and
how long after its start `debug=fdr` reaches its first training step.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
PYTHON = sys.executable
# models whose steps take a second on a CPU core: a few steps per epoch are enough to compare
SMALL_SAMPLES = {"resnet18": 128 * 6}
IMAGE_SHAPES = {"resnet18": "[3,32,32]"}


# ---------------------------------------------------------------- worker (all variants in one process)


class Setup:
    """What the three variants share: processes, device, data tensors, the composed template config."""

    def __init__(self, model: str, samples: int, batch_size: int, epochs: int) -> None:
        import torch
        import torch.distributed as dist

        from hpctrain.runtime.config.compose import compose

        self.model, self.samples, self.batch_size, self.epochs = model, samples, batch_size, epochs
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.gpu = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if self.gpu else "cpu")
        if self.gpu:
            torch.cuda.set_device(self.device)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.gpu else "gloo")
        self.out = tempfile.mkdtemp(prefix="benchmark-")
        atexit.register(shutil.rmtree, self.out, ignore_errors=True)  # its checkpoints are not wanted
        trainer = ("ddp" if self.gpu else "ddp_cpu") if self.world > 1 else ("gpu" if self.gpu else "cpu")
        overrides = [
            f"model={model}",
            "data=random",
            f"data.image_shape={IMAGE_SHAPES.get(model, '[1,28,28]')}",
            f"data.num_samples={samples}",
            f"data.val_samples={2 * batch_size}",
            f"data.test_samples={batch_size}",
            f"data.batch_size={batch_size}",
            "data.seed=0",
            f"data.pin_memory={self.gpu}",
            f"trainer={trainer}",
            f"trainer.devices={self.world}",
            f"trainer.max_epochs={epochs}",
            "trainer.num_sanity_val_steps=0",
            "callbacks.early_stopping=null",
            f"paths.output_dir={self.out}",
            f"paths.log_dir={self.out}",
            "seed=0",
        ]
        self.cfg = compose("train", overrides)
        from hydra.utils import instantiate

        datamodule = instantiate(self.cfg.data)
        self.images, self.labels = datamodule.load()[0][:]
        self.mean, self.scale = 255.0 * datamodule.mean[0], 1.0 / (255.0 * datamodule.std[0])

    def network_and_optimizer(self):
        """The model config's network and optimizer: the same for all three variants."""
        import torch
        from hydra.utils import instantiate

        torch.manual_seed(0)
        net = instantiate(self.cfg.model.net, _convert_="all").to(self.device)
        return net, instantiate(self.cfg.model.optimizer)

    def batches(self, epoch: int):
        """This rank's batches for one epoch, as a hand-written DDP loop makes them."""
        import torch
        from torch.utils.data import DistributedSampler

        sampler = DistributedSampler(
            range(len(self.labels)), num_replicas=self.world, rank=int(os.environ.get("RANK", 0)), seed=0
        )
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            x = self.images[index].to(self.device, non_blocking=True).float().sub_(self.mean).mul_(self.scale)
            yield x, self.labels[index].to(self.device, non_blocking=True)

    def steps_per_epoch(self) -> int:
        import math

        return math.ceil(math.ceil(len(self.labels) / self.world) / self.batch_size)

    def sync(self) -> None:
        import torch

        if self.gpu:
            torch.cuda.synchronize()


def run_raw(setup: Setup) -> list[float]:
    """A hand-written loop, as in PyTorch's DDP tutorial: sampler, forward, backward, step."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    net, make_optimizer = setup.network_and_optimizer()
    if setup.world > 1:
        net = DistributedDataParallel(net, device_ids=[setup.device.index] if setup.gpu else None)
    optimizer = make_optimizer(params=net.parameters())
    rates = []
    for epoch in range(setup.epochs):
        setup.sync()
        started = time.perf_counter()
        seen = 0
        for x, y in setup.batches(epoch):
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(y)
        setup.sync()
        rates.append(seen * setup.world / (time.perf_counter() - started))
    return rates


def run_lightning(setup: Setup) -> list[float]:
    """Lightning's bare loop: a minimal LightningModule, no callbacks, metrics, logging or checkpoints.
    Its gap to `raw` is Lightning's own per-step cost, which the template cannot remove."""
    import pytorch_lightning as pl
    import torch.nn.functional as F

    from hpctrain.runtime import namespaces
    from hpctrain.runtime.distributed import launch

    net, make_optimizer = setup.network_and_optimizer()

    class Bare(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return make_optimizer(params=self.parameters())

    class Batches:
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            return setup.batches(self.epoch)

        def __len__(self) -> int:
            return setup.steps_per_epoch()

    class Timer(pl.Callback):
        rates: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module):
            setup.sync()
            self.started, self.seen = time.perf_counter(), 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen += len(batch[1])

        def on_train_epoch_end(self, trainer, pl_module):
            setup.sync()
            self.rates.append(self.seen * setup.world / (time.perf_counter() - self.started))

    timer = Timer()
    timer.rates = []
    loader = Batches()

    class Epochs(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            loader.set_epoch(trainer.current_epoch)

    trainer = pl.Trainer(
        accelerator="gpu" if setup.gpu else "cpu",
        devices=setup.world,
        strategy="ddp" if setup.world > 1 else "auto",
        plugins=[launch.lightning_cluster_environment(namespaces.PYTORCH_LIGHTNING)],
        max_epochs=setup.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=[Epochs(), timer],
    )
    trainer.fit(Bare(), train_dataloaders=loader)
    return timer.rates


def run_template(setup: Setup) -> list[float]:
    """The template's own path: config -> build -> Trainer.fit, as src/train.py does it (loggers off)."""
    from hpctrain.callbacks.throughput_log import ThroughputLog
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.distributed import watchdog
    from hpctrain.runtime.run import build

    class EpochRates(ThroughputLog):
        """The default ThroughputLog (same per-step work), keeping each epoch's rate."""

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            super().on_train_epoch_end(trainer, pl_module)
            self.rates.append(self.samples * trainer.world_size / self.seconds)

    recorder = EpochRates()
    recorder.rates = []
    settings = Settings.of(setup.cfg)
    build.configure_process(settings, setup.cfg.data)
    trainer = build.trainer(setup.cfg, settings, setup.out, logger=[])
    trainer.callbacks = [recorder if isinstance(c, ThroughputLog) else c for c in trainer.callbacks]
    trainer.fit(build.model(setup.cfg.model, settings), build.datamodule(setup.cfg.data, settings))
    # as src/train.py's end does (end_distributed_job): the rank watchdog the run started stops before
    # the next variant or the process group's end; left inside a store request it can abort the process
    watchdog.stop()
    return recorder.rates


VARIANTS = {"raw": run_raw, "lightning": run_lightning, "template": run_template}


def worker(args: argparse.Namespace) -> None:
    """Run raw, bare Lightning and the template in turn, `repeats` times, in this process (and its
    torchrun siblings); print each variant's per-epoch rates without the warm-up epoch of each run."""
    setup = Setup(args.model, args.samples, args.batch_size, args.epochs)
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for repeat in range(args.repeats):
        for name in names[repeat % 3 :] + names[: repeat % 3]:
            measured = VARIANTS[name](setup)
            rates[name] += measured[1:] if len(measured) > 1 else measured
    if int(os.environ.get("RANK", "0")) == 0:
        print("RATES " + json.dumps(rates), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def _launch(model: str, world: int, args: argparse.Namespace) -> dict[str, float]:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        "--model",
        model,
        "--samples",
        str(SMALL_SAMPLES.get(model, args.samples) if not args.tiny else args.samples),
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--repeats",
        str(args.repeats),
    ]
    if world > 1:
        command = [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            *script,
        ]
    else:
        command = [PYTHON, *script]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    found = re.search(r"^RATES (.*)$", result.stdout, re.MULTILINE)
    if result.returncode != 0 or not found:
        raise RuntimeError(f"{model} x{world} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return {name: statistics.median(rates) for name, rates in json.loads(found.group(1)).items()}


def throughput(args: argparse.Namespace) -> list[dict]:
    results = []
    for model in args.models:
        for world in args.world_sizes:
            rates = _launch(model, world, args)
            step_ms = {name: args.batch_size * world / rate * 1000 for name, rate in rates.items()}
            row = {
                "model": model,
                "world_size": world,
                "raw_samples_per_s": round(rates["raw"], 1),
                "lightning_samples_per_s": round(rates["lightning"], 1),
                "template_samples_per_s": round(rates["template"], 1),
                "ratio": round(rates["template"] / rates["raw"], 3),
                "lightning_ratio": round(rates["lightning"] / rates["raw"], 3),
                "template_over_lightning": round(rates["template"] / rates["lightning"], 3),
                # per-step costs from the same medians: Lightning's over the raw loop, the template's over Lightning
                "lightning_overhead_ms": round(step_ms["lightning"] - step_ms["raw"], 3),
                "template_overhead_ms": round(step_ms["template"] - step_ms["lightning"], 3),
                "raw_step_ms": round(step_ms["raw"], 3),
            }
            print(
                f"  {model:10s} x{world}: raw {row['raw_samples_per_s']:8.0f}  lightning {row['lightning_samples_per_s']:8.0f}"
                f"  template {row['template_samples_per_s']:8.0f}  template/lightning {row['template_over_lightning']:.3f}"
                f"  (step {row['raw_step_ms']:.2f} ms; Lightning +{row['lightning_overhead_ms']:.3f} ms,"
                f" template +{row['template_overhead_ms']:.3f} ms)",
                flush=True,
            )
            results.append(row)
    return results


def diagnostics_cost(steps: int) -> dict[str, float]:
    """Microseconds per training step that the template's per-step diagnostics add, measured on their
    hooks alone: the straggler clock and the collective position (RankWatchdog under DDP: three hooks,
    two host clocks, no device sync) and the NaN watch (NonFiniteLoss: a reference to the loss kept)."""
    from types import SimpleNamespace

    import torch

    from hpctrain.callbacks.non_finite_loss import NonFiniteLoss
    from hpctrain.callbacks.performance_log import PerformanceLog
    from hpctrain.callbacks.rank_watchdog import RankWatchdog

    watchdog = RankWatchdog()
    watchdog._several = True
    progress = SimpleNamespace(is_last_batch=False)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    nan = NonFiniteLoss("unused", check_every_n_steps=1000)
    loss = {"loss": torch.tensor(0.5)}
    # callbacks.performance as configured, its log interval (every 10 steps, as the quickstart's) included;
    # the loggers' own writing is not its cost
    performance = PerformanceLog(data_wait_warn=1.0)  # hooks called back to back "wait" for nothing real
    performance._every, performance._flops_done = 10, True
    performance_trainer = SimpleNamespace(
        global_rank=0, is_global_zero=True, world_size=1, loggers=[], global_step=0
    )
    batch = (torch.zeros(32, 1, 8, 8), torch.zeros(32, dtype=torch.long))

    def per_step(step: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return 1e6 * (time.perf_counter() - start) / steps

    def straggler_step() -> None:
        watchdog.on_train_batch_start(trainer, None, None, 0)
        watchdog.on_before_backward(trainer, None, None)
        watchdog.on_train_batch_end(trainer, None, None, None, 0)

    def nan_step() -> None:
        nan.on_train_batch_end(trainer, None, loss, None, 0)
        if len(nan._losses) > 500:
            nan._losses.clear()

    def performance_step() -> None:
        performance.on_train_batch_start(performance_trainer, None, batch, 0)
        performance.on_train_batch_end(performance_trainer, None, None, batch, 0)

    return {
        "stragglers_us": per_step(straggler_step),
        "nan_us": per_step(nan_step),
        "performance_us": per_step(performance_step),
    }


def quickstart_step_ms(epochs: int) -> float:
    """The quickstart's median CPU training step, as its own performance figures report it."""
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "src/train.py",
            "experiment=quickstart",
            f"trainer.max_epochs={epochs}",
            f"paths.log_dir={tmp}",
            "extras.print_config=false",
        ]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        (run,) = (Path(tmp) / "train" / "runs").iterdir()
        return float(yaml.safe_load((run / "outcome.yaml").read_text())["performance"]["step_ms"])


def data_pipeline(batch_size: int, batches: int) -> dict:
    """Training batches per second of CIFAR-shaped data (no model): the template's pipeline (uint8 in
    memory, one index per batch, random crop + flip + normalise on whole batches) against the common
    per-sample one (PIL images, torchvision's RandomCrop, RandomHorizontalFlip, ToTensor, Normalize in a
    Dataset, with a DataLoader at its best num_workers for this machine), in this process."""
    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset
    from torchvision import transforms

    from hpctrain.data.loading import TensorDataset, make_loader
    from myproject.data.cifar import CIFAR10DataModule, random_crop_and_flip

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size * batches, 3, 32, 32), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (len(images),), generator=generator)
    mean, std = CIFAR10DataModule.default_mean, CIFAR10DataModule.default_std
    normaliser = CIFAR10DataModule(data_dir="unused", mean=mean, std=std)

    def ours() -> float:
        loader = make_loader(TensorDataset(images, labels), batch_size, shuffle=True, seed=0)
        started = time.perf_counter()
        for x, _ in loader:
            normaliser.normalise(random_crop_and_flip(x, 4, True))
        return batches / (time.perf_counter() - started)

    hwc = images.permute(0, 2, 3, 1).contiguous().numpy()

    class PerSample(Dataset):
        transform = transforms.Compose(
            [
                transforms.RandomCrop(32, padding=4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(mean, std),
            ]
        )

        def __len__(self) -> int:
            return len(hwc)

        def __getitem__(self, index: int):
            return self.transform(Image.fromarray(np.asarray(hwc[index]))), int(labels[index])

    def theirs(workers: int) -> float:
        loader = DataLoader(PerSample(), batch_size=batch_size, shuffle=True, num_workers=workers)
        started = time.perf_counter()
        for _ in loader:
            pass
        return batches / (time.perf_counter() - started)

    template = statistics.median(ours() for _ in range(3))
    per_workers = {w: theirs(w) for w in (0, 1, 2, os.cpu_count() or 2) if w <= (os.cpu_count() or 2)}
    best = max(per_workers, key=per_workers.get)
    return {
        "batch_size": batch_size,
        "template_batches_per_s": round(template, 1),
        "torchvision_batches_per_s": round(per_workers[best], 1),
        "torchvision_num_workers": best,
        "ratio": round(template / per_workers[best], 3),
    }


COMPOSED = {"HPCTRAIN_ANSWER_CACHE": "0"}  # Hydra composes: the first question after any change
STARTUP = {
    "import hydra": (["-c", "import hydra"], {}),
    "--help": (["src/train.py", "--help"], {}),
    "--cfg job": (["src/train.py", "--cfg", "job", "experiment=quickstart"], {}),
    "--help composed": (["src/train.py", "--help"], COMPOSED),
    "--cfg job composed": (["src/train.py", "--cfg", "job", "experiment=quickstart"], COMPOSED),
}


def startup_costs(repeats: int) -> tuple[dict[str, float], float]:
    """Median wall time of each STARTUP command, taken in turn round after round (so a busy moment
    slows all alike), and the peak RSS (MB) of `--help` composed. `python -c "import hydra"` is the
    floor under Hydra's composition; a question asked again is answered from the answer stored the first
    time (`hpctrain.runtime.config.answers`), which one untimed round stores in a cache of its own."""
    times: dict[str, list[float]] = {name: [] for name in STARTUP}
    peak = 0.0
    with tempfile.TemporaryDirectory() as cache:
        for round_ in range(repeats + 1):
            for name, (args, env) in STARTUP.items():
                started = time.perf_counter()
                process = subprocess.Popen(
                    [PYTHON, *args],
                    stdout=subprocess.DEVNULL,
                    cwd=ROOT,
                    env={**os.environ, "XDG_CACHE_HOME": cache, **env},
                )
                _, status, usage = os.wait4(process.pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise RuntimeError(f"python {' '.join(args)} failed")
                if round_ == 0:
                    continue  # stores the answers
                times[name].append(time.perf_counter() - started)
                if name == "--help composed":
                    peak = max(peak, usage.ru_maxrss / 1024)
    return {name: statistics.median(values) for name, values in times.items()}, peak


def import_cost(module: str, repeats: int) -> float:
    """Median wall time of `python -c "import <module>"`: the floor under any command that needs it."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([PYTHON, "-c", f"import {module}"], check=True, cwd=ROOT)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def first_step_seconds(repeats: int) -> float:
    """How long after its start `python src/train.py debug=fdr` begins its first training step."""
    seconds = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            result = subprocess.run(
                [
                    PYTHON,
                    str(ROOT / "src" / "train.py"),
                    "debug=fdr",
                    "data=random",
                    "trainer=cpu",
                    f"paths.log_dir={out}",
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=300,
            )
        found = re.search(
            r"first training step ([0-9.]+) s after the process started", result.stdout + result.stderr
        )
        if result.returncode != 0 or not found:
            raise RuntimeError(f"debug=fdr failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        seconds.append(float(found.group(1)))
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "mnist_cnn", "resnet18"],
        choices=["mlp", "mnist_cnn", "resnet18"],
    )
    parser.add_argument("--skip-data-pipeline", action="store_true", help="leave out the data-pipeline row")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--samples", type=int, default=128 * 160, help="training samples per epoch (all processes)"
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is warm-up")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of raw, bare Lightning and template runs per row"
    )
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (the test suite's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny:
        args.models, args.samples, args.epochs, args.repeats = ["mlp"], 128 * 8, 2, 1

    repeats = 1 if args.tiny else 5
    print("startup:", flush=True)
    startup, help_rss = startup_costs(repeats)
    import_hydra = startup["import hydra"]
    print(
        f"  python -c 'import hydra': {import_hydra:.3f} s (median of {repeats}, in turn with the next four)",
        flush=True,
    )
    for name in ("--help", "--cfg job"):
        command = " ".join(STARTUP[name][0][1:])
        ratio, composed = startup[name] / import_hydra, startup[f"{name} composed"] / import_hydra
        print(
            f"  python src/train.py {command}: {startup[name]:.3f} s = {ratio:.2f}x import hydra asked again;"
            f" composed by Hydra (the first time after anything it depends on changed):"
            f" {startup[f'{name} composed']:.3f} s = {composed:.2f}x"
            + (f", peak RSS {help_rss:.0f} MB" if name == "--help" else ""),
            flush=True,
        )
    import_lightning = import_cost("pytorch_lightning", 1 if args.tiny else 3)
    first_step = first_step_seconds(1 if args.tiny else 3)
    print(f"  debug=fdr first training step: {first_step:.2f} s after process start", flush=True)
    print(f"  python -c 'import pytorch_lightning': {import_lightning:.2f} s", flush=True)
    print(
        f"throughput, samples/s (batch {args.batch_size}, {args.samples} samples per epoch, median of the epochs after"
        f" the first of each run, {args.repeats} rounds):",
        flush=True,
    )
    results = throughput(args)
    diagnostics = diagnostics_cost(2_000 if args.tiny else 100_000)
    quickstart_ms = quickstart_step_ms(2 if args.tiny else 5)
    share = diagnostics["performance_us"] / (10 * quickstart_ms)  # us over ms, in percent
    print(
        f"per-step diagnostics: stragglers and collective position {diagnostics['stragglers_us']:.2f} us, "
        f"NaN watch {diagnostics['nan_us']:.2f} us (looked at every nan.check_every_n_steps, one host sync then), "
        f"performance figures {diagnostics['performance_us']:.2f} us = {share:.3f}% of the quickstart's CPU step "
        f"({quickstart_ms:.2f} ms)",
        flush=True,
    )
    pipeline = None
    if not args.skip_data_pipeline and importlib.util.find_spec("myproject.data.cifar") is not None:
        pipeline = data_pipeline(args.batch_size, 8 if args.tiny else 40)
        print(
            f"data pipeline, CIFAR-10 training batches of {pipeline['batch_size']} per second (no model): template"
            f" {pipeline['template_batches_per_s']:.0f}, torchvision per-sample {pipeline['torchvision_batches_per_s']:.1f}"
            f" (num_workers={pipeline['torchvision_num_workers']}): {pipeline['ratio']:.1f}x",
            flush=True,
        )
    report = {
        "results": results,
        "help_s": round(startup["--help"], 3),
        "help_peak_rss_mb": round(help_rss, 1),
        "cfg_job_s": round(startup["--cfg job"], 3),
        "import_hydra_s": round(import_hydra, 3),
        "help_over_import_hydra": round(startup["--help"] / import_hydra, 3),
        "cfg_job_over_import_hydra": round(startup["--cfg job"] / import_hydra, 3),
        "help_composed_s": round(startup["--help composed"], 3),
        "cfg_job_composed_s": round(startup["--cfg job composed"], 3),
        "help_composed_over_import_hydra": round(startup["--help composed"] / import_hydra, 3),
        "cfg_job_composed_over_import_hydra": round(startup["--cfg job composed"] / import_hydra, 3),
        "first_step_s": round(first_step, 2),
        "import_lightning_s": round(import_lightning, 2),
        "data_pipeline": pipeline,
        "diagnostics_us_per_step": {k: round(v, 3) for k, v in diagnostics.items()},
        "quickstart_step_ms": round(quickstart_ms, 3),
        "performance_share_of_quickstart_step": round(share / 100, 6),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
