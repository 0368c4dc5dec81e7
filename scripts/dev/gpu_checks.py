"""The checks that need a GPU machine (none ran on the development machine, which has no GPU).

    python scripts/dev/gpu_checks.py            # on a machine with 1+ NVIDIA GPUs; writes gpu_checks.json

1. Host-device synchronisation: a few training and validation steps of the template's classifier with
   `torch.cuda.set_sync_debug_mode("warn")`, counting the synchronising calls each step makes.
2. Precisions: one batch of fit and test in 32-true, bf16-mixed, 16-mixed, bf16-true (fast_dev_run).
3. DDP over nccl with every GPU of the machine (when there are 2+): a real `python src/train.py` run.
4. NCCL's flight recorder (2+ GPUs): a run whose rank 1 sleeps past a 12-second collective timeout must
   end naming rank 1 and leave <run dir>/flight_recorder/rank<N> files that `torchfrtrace` reads.
5. Performance figures: a short run with `debug=trace` must log the FLOP/s and MFU (on a GPU in Lightning's
   table), NVML's utilisation, memory and power of every GPU, and write a trace and a CUDA memory snapshot.
6. FSDP2 (2+ GPUs): the character Transformer with trainer=fsdp (bf16-mixed, nccl) on every GPU, a sharded
   checkpoint, and a resume of it on half the GPUs.
Then run `python scripts/dev/benchmark.py` and `python scripts/dev/fsdp_benchmark.py` there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def synchronising_calls(out: Path) -> dict[str, int]:
    """Each place that synchronised the host with the GPU during training steps 5-14 and one
    validation, with how often: what the template could avoid is then plain to see."""
    import torch
    from pytorch_lightning import Callback

    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.run import build

    overrides = [
        "data=random",
        "model=mnist_cnn",
        "trainer=gpu",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1000",
        "trainer.limit_train_batches=20",
        "trainer.limit_val_batches=5",
        "trainer.num_sanity_val_steps=0",
        f"paths.output_dir={out}",
        f"paths.log_dir={out}",
    ]
    cfg = compose("train", overrides)

    class Window(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("warn" if 5 <= batch_idx < 15 else "default")

        def on_validation_start(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode("warn")

        def on_validation_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode("default")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build.trainer(cfg, out, logger=False)
        trainer.callbacks.append(Window())
        trainer.fit(build.model(cfg), build.datamodule(cfg))
    places: dict[str, int] = {}
    for warning in caught:
        if "synchroniz" in str(warning.message):
            place = f"{Path(warning.filename).name}:{warning.lineno}"
            places[place] = places.get(place, 0) + 1
    return places


def flight_recorder(out: Path) -> dict[str, object]:
    """A rank stuck past the collective timeout on nccl: the sentence naming it, and the recorder's dumps."""
    import os

    run = out / "flight"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "SLEEP_RANK": "1",
        "SLEEP_AT_STEP": "3",
        "SLEEP_S": "120",
        "SLEEP_MARK": str(out / "asleep"),
    }
    result = subprocess.run(
        [
            sys.executable,
            "src/train.py",
            f"hydra.searchpath=[file://{ROOT}/tests/differential/conf]",
            "model=user",
            "model._target_=tests.differential.user_code.SleepyRank",
            "data=user",
            "data._target_=tests.differential.user_code.DigitsData",
            "monitor.metric=val_loss",
            "monitor.mode=min",
            "trainer=ddp",
            "trainer.devices=2",
            "trainer.max_epochs=1",
            "dist.timeout_min=0.2",
            f"hydra.run.dir={run}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    dumps = sorted(p.name for p in (run / "flight_recorder").glob("rank*"))
    read = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(run / "flight_recorder"),
            "--prefix",
            "rank",
        ],
        capture_output=True,
        text=True,
    )
    return {
        "rank 1 named": "rank 1 on" in result.stdout + result.stderr,
        "dumps": dumps,
        "torchfrtrace exit status": read.returncode,
    }


def performance_figures(out: Path) -> dict[str, object]:
    """The figures callbacks.performance logs on a GPU, and what debug=trace wrote."""
    import csv

    import yaml

    logs = out / "perf"
    command = [
        sys.executable,
        "src/train.py",
        "experiment=quickstart",
        "trainer=gpu",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=5",
        "callbacks.performance.gpu_every_s=1",
        "debug=trace",
        f"paths.log_dir={logs}",
    ]
    result = subprocess.run(command, cwd=ROOT)
    runs = sorted((logs / "debug" / "runs").iterdir()) if result.returncode == 0 else []
    if not runs:
        return {"ran": False}
    run = runs[-1]
    with open(run / "metrics.csv", newline="") as file:
        columns = set(next(csv.reader(file)))
    performance = yaml.safe_load((run / "outcome.yaml").read_text()).get("performance", {})
    return {
        "ran": True,
        "tflops_per_device": performance.get("tflops_per_device"),
        "mfu": performance.get("mfu"),
        "nvml columns": sorted(c for c in columns if c.startswith("gpus/")),
        "trace files": sorted(p.name for p in (run / "traces").iterdir()),
    }


def fsdp2(out: Path, gpus: int) -> dict[str, object]:
    """FSDP2 with bf16 and nccl on every GPU, its sharded checkpoint, and a resume on half the GPUs."""
    common = [sys.executable, "src/train.py", "experiment=char_transformer", "trainer=fsdp", "trainer.max_epochs=1",
              "trainer.limit_train_batches=20", "trainer.limit_val_batches=2", "test=false"]  # fmt: skip
    first = subprocess.run([*common, f"trainer.devices={gpus}", f"paths.log_dir={out}/fsdp"], cwd=ROOT)
    folders = sorted((out / "fsdp" / "train" / "runs").glob("*/checkpoints/last.ckpt"))
    report: dict[str, object] = {"trained": first.returncode == 0, "sharded checkpoint": bool(folders)}
    if folders:
        shards = sorted(p.name for p in folders[-1].glob("*.distcp"))
        report["shards"] = len(shards)
        resumed = subprocess.run(
            [*common, f"trainer.devices={max(1, gpus // 2)}", "trainer.max_epochs=2", f"ckpt_path={folders[-1]}",
             f"paths.log_dir={out}/resumed"],
            cwd=ROOT,
        )  # fmt: skip
        report["resumed on fewer GPUs"] = resumed.returncode == 0
    return report


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU here; run this on a GPU machine.", file=sys.stderr)
        return 2
    report: dict = {"gpus": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory() as tmp:
        report["synchronising calls in 10 training steps and a validation"] = synchronising_calls(Path(tmp))
        train = [
            sys.executable,
            "src/train.py",
            "data=random",
            "model=mnist_cnn",
            f"paths.log_dir={tmp}",
            "debug=fdr",
        ]
        for precision in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
            result = subprocess.run([*train, "trainer=gpu", f"trainer.precision={precision}"], cwd=ROOT)
            report[f"precision {precision}"] = result.returncode == 0
        report["performance figures"] = performance_figures(Path(tmp))
        if torch.cuda.device_count() > 1:
            result = subprocess.run(
                [*train, "trainer=ddp", f"trainer.devices={torch.cuda.device_count()}"], cwd=ROOT
            )
            report["ddp nccl"] = result.returncode == 0
            report["nccl flight recorder"] = flight_recorder(Path(tmp))
            report["fsdp2"] = fsdp2(Path(tmp), torch.cuda.device_count())
    (ROOT / "gpu_checks.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
