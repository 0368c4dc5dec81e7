"""FSDP2 against DDP, and the template against bare Lightning, on the character Transformer at ~50 M
parameters, side by side in one run (part of `make benchmark`).

    python scripts/dev/fsdp_benchmark.py                       # 2 processes (torchrun), CPU or GPU
    python scripts/dev/fsdp_benchmark.py --tiny --json out.json

Three variants train the same network (n_layer 16, n_embd 512, batch 4 x 128, AdamW) in turn inside
two processes of their own per run, for `--rounds` rounds (rotated, so none always runs first):

  ddp        the template (build.trainer: config, callbacks, checkpoint IO) with trainer=ddp_cpu/ddp
  fsdp       the template with trainer=fsdp_cpu/fsdp: hpctrain shards the model (dist.fsdp.shard=auto)
  bare       Lightning's ModelParallelStrategy, the module's own configure_model applying the same
             fully_shard calls, no template callback

Per variant: the median step time of the steps after `--warmup` (host clock at each step's end),
each rank's bytes of parameters, gradients and optimizer states (the local shards), the peak RSS, and
after training the checkpoint saves, `--saves` of each kind: synchronous, and asynchronous through one
writer as a run makes them (the stall training sees, its share of a synchronous save's, and the time
until the checkpoint is in place), with each rank's bytes on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
PYTHON = sys.executable
VARIANTS = ("ddp", "fsdp", "bare")
ASYNC_STALL_GOAL = 1 / 8  # an asynchronous save stalls training at most this share of a synchronous one


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _overrides(args: argparse.Namespace, out: str, trainer: str) -> list[str]:
    return [
        "experiment=char_transformer",
        f"trainer={trainer}",
        f"trainer.devices={int(os.environ.get('WORLD_SIZE', '1'))}",
        f"trainer.max_steps={args.steps}",
        "trainer.limit_train_batches=null",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.max_epochs=null",
        "test=false",
        f"model.net.n_layer={args.layers}",
        f"model.net.n_embd={args.embd}",
        "model.net.n_head=8",
        "model.net.dropout=0.0",
        "data.batch_size=4",
        "data.block_size=128",
        "monitor.metric=null",  # no validation here
        "callbacks.early_stopping=null",
        "callbacks.model_checkpoint=null",
        "callbacks.text_sample=null",
        f"paths.output_dir={out}",
        f"paths.log_dir={out}",
        "seed=0",
    ]


def _measure_cb(args: argparse.Namespace, found: dict):
    import pytorch_lightning as pl

    class Measure(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_start(self, trainer, pl_module) -> None:
            _reset_peak()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if torch_cuda():
                import torch

                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            if len(self.ends) == args.warmup:  # gradients and optimizer states exist by now
                params = list(pl_module.parameters())
                found["param_bytes"] = _local_bytes(params)
                found["grad_bytes"] = _local_bytes(p.grad for p in params if p.grad is not None)
                optimizer = trainer.optimizers[0]
                found["optimizer_bytes"] = _local_bytes(
                    v
                    for s in optimizer.state.values()
                    for v in s.values()
                    if hasattr(v, "numel") and v.dim() > 0
                )

        def on_train_end(self, trainer, pl_module) -> None:
            steps = [
                b - a for a, b in zip(self.ends[args.warmup :], self.ends[args.warmup + 1 :], strict=False)
            ]
            found["step_s"] = statistics.median(steps)
            found["steps_measured"] = len(steps)
            found["peak_rss_mib"] = _peak_rss_mib()

    return Measure()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _saves(trainer, out: Path, found: dict, repeats: int) -> None:
    """`repeats` rounds of a synchronous save then an asynchronous one, side by side so that both see the
    same machine; the asynchronous ones through one writer, as a run makes them (the first pays for its
    host buffers, the next ones reuse them): the stall training sees, the time until the checkpoint is in
    place, and each rank's bytes on disk."""
    import shutil

    from hpctrain.runtime.distributed.requeue import wait_for_saves
    from hpctrain.runtime.storage.checkpoints.async_writing import AsyncAtomicCheckpointIO

    rank = trainer.global_rank
    strategy, io = trainer.strategy, trainer.strategy.checkpoint_io
    writer = None if hasattr(strategy, "saves") else AsyncAtomicCheckpointIO()  # FSDP2: folder_saves's own
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    dones: dict[str, list[float]] = {"sync": [], "async": []}
    for index in range(repeats):
        for kind in ("sync", "async"):
            asynchronous = kind == "async"
            if writer is None:
                strategy.saves.asynchronous = asynchronous
            else:
                strategy.checkpoint_io = writer if asynchronous else io
            path = Path(strategy.broadcast(str(out / f"{kind}-{index}.ckpt")))  # rank 0's folder
            strategy.barrier()
            started = time.perf_counter()
            trainer.save_checkpoint(path)
            stalls[kind].append(time.perf_counter() - started)
            wait_for_saves(trainer)
            strategy.barrier()
            dones[kind].append(time.perf_counter() - started)
            if path.is_dir():
                mine = path / f"__{rank}_0.distcp"
                found[f"save_{kind}_bytes"] = mine.stat().st_size if mine.exists() else 0
            else:
                found[f"save_{kind}_bytes"] = path.stat().st_size if rank == 0 and path.exists() else 0
            strategy.barrier()
            if rank == 0:  # gigabytes per save: not kept
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    for kind in ("sync", "async"):
        steady = (
            stalls[kind][1:] if kind == "async" and repeats > 1 else stalls[kind]
        )  # a run's after its first
        found[f"save_{kind}_stall_s"] = statistics.median(steady)
        found[f"save_{kind}_first_stall_s"] = stalls[kind][0]
        found[f"save_{kind}_done_s"] = statistics.median(dones[kind])
    strategy.checkpoint_io = io
    if writer is None:
        strategy.saves.close()


def run_template(args: argparse.Namespace, variant: str, found: dict) -> None:
    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.run import build

    gpu = torch_cuda()
    trainer_name = {"ddp": "ddp" if gpu else "ddp_cpu", "fsdp": "fsdp" if gpu else "fsdp_cpu"}[variant]
    out = Path(tempfile.mkdtemp(prefix="fsdp-benchmark-"))
    cfg = compose("train", _overrides(args, str(out), trainer_name))
    settings = Settings.of(cfg)
    build.configure_process(settings, cfg.data)
    trainer = build.trainer(cfg, settings, out, logger=[])
    trainer.callbacks.append(_measure_cb(args, found))
    trainer.fit(build.model(cfg.model, settings), build.datamodule(cfg.data, settings))
    _saves(trainer, out, found, args.saves)


def run_bare(args: argparse.Namespace, variant: str, found: dict) -> None:
    import pytorch_lightning as pl
    from hydra.utils import instantiate
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.run import build

    out = Path(tempfile.mkdtemp(prefix="fsdp-benchmark-"))
    cfg = compose("train", _overrides(args, str(out), "fsdp_cpu"))
    build.configure_process(Settings.of(cfg), cfg.data)  # the same threads per process as the template's runs
    base = instantiate({"_target_": "hydra.utils.get_class", "path": cfg.model._target_})

    class Sharded(base):  # the way Lightning's docs write it
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    pl.seed_everything(0, verbose=False)
    model = instantiate(cfg.model, _convert_="all")
    model.__class__ = Sharded  # the same module, with its own configure_model
    data = instantiate(cfg.data, _convert_="all")
    trainer = pl.Trainer(
        accelerator="gpu" if torch_cuda() else "cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=ModelParallelStrategy(
            data_parallel_size=int(os.environ.get("WORLD_SIZE", "1")), tensor_parallel_size=1
        ),
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_measure_cb(args, found)],
        default_root_dir=str(out),
    )
    trainer.fit(model, data)


def worker(args: argparse.Namespace) -> None:
    """One variant, in these processes of their own (so the peak RSS is the variant's)."""
    import torch.distributed as dist

    found: dict = {}
    (run_bare if args.variant == "bare" else run_template)(args, args.variant, found)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # every group, the asynchronous saves' included
    # The saves above ran after fit's teardown, outside a run's lifecycle: at interpreter exit a gloo
    # thread of the saves' group is sometimes still joinable and the C++ runtime aborts (SIGABRT) after
    # the figures are out. They are: end here, as torchrun's workers may.
    sys.stdout.flush()
    os._exit(0)


def _summary(results: dict) -> dict:
    def per_rank_median(variant: str, key: str) -> float:
        return statistics.median(r[key] for rounds in results[variant] for r in rounds if key in r)

    def step(variant: str) -> float:
        return statistics.median(rounds[0]["step_s"] for rounds in results[variant])

    tensors = ("param_bytes", "grad_bytes", "optimizer_bytes")
    state = {v: sum(per_rank_median(v, k) for k in tensors) for v in ("ddp", "fsdp")}
    world = len(results["fsdp"][0])
    summary = {
        "world_size": world,
        "step_s": {v: round(step(v), 4) for v in VARIANTS},
        "template_over_bare_throughput": round(step("bare") / step("fsdp"), 3),
        "state_bytes_per_rank": {v: int(b) for v, b in state.items()},
        "fsdp_state_over_ddp": round(state["fsdp"] / state["ddp"], 3),
        "fsdp_state_goal": round(1 / world + 0.1, 3),
        "peak_rss_mib": {v: round(per_rank_median(v, "peak_rss_mib"), 1) for v in VARIANTS},
    }
    for v in ("ddp", "fsdp"):
        keys = ("sync_stall_s", "sync_done_s", "async_first_stall_s", "async_stall_s", "async_done_s")
        for k in keys:
            summary.setdefault("saves", {}).setdefault(v, {})[k] = round(per_rank_median(v, f"save_{k}"), 3)
        saves = summary["saves"][v]
        saves["bytes_per_rank"] = [r["save_sync_bytes"] for r in results[v][0]]
        # the stall training sees against a synchronous save of the same state, in the same processes
        saves["async_stall_over_sync"] = round(saves["async_stall_s"] / saves["sync_stall_s"], 3)
        saves["async_first_stall_over_sync"] = round(saves["async_first_stall_s"] / saves["sync_stall_s"], 3)
    summary["async_stall_goal"] = ASYNC_STALL_GOAL
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--saves", type=int, default=3, help="saves of each kind (the first async one allocates)"
    )
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.embd, args.steps, args.warmup, args.rounds, args.saves = 2, 64, 6, 2, 1, 2
    if args.worker:
        worker(args)
        return
    results: dict[str, list] = {v: [] for v in VARIANTS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for round_ in range(args.rounds):
        for variant in VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]:  # rotated: none always first
            if variant == "ddp" and round_ > 0:
                continue  # DDP is the memory and save reference; its figures do not change between rounds
            command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.processes}",
                       str(Path(__file__).resolve()), "--worker", "--variant", variant, "--layers", str(args.layers),
                       "--embd", str(args.embd), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--saves", str(args.saves)]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
            found = re.search(r"^RESULT (.*)$", result.stdout, re.MULTILINE)
            if result.returncode != 0 or not found:
                print(result.stdout[-4000:], result.stderr[-4000:], file=sys.stderr)
                sys.exit(1)
            results[variant].append(json.loads(found.group(1)))
    summary = _summary(results)
    params = 12 * args.layers * args.embd**2
    print(
        f"character Transformer, ~{params / 1e6:.0f} M parameters in its blocks, {summary['world_size']} processes:"
    )
    print(f"  step s (median after warm-up): {summary['step_s']}")
    print(f"  template/bare ModelParallelStrategy throughput: {summary['template_over_bare_throughput']}")
    print(
        f"  parameters+gradients+optimizer states per rank: FSDP2 {summary['state_bytes_per_rank']['fsdp'] / 2**20:.0f} MiB,"
        f" DDP {summary['state_bytes_per_rank']['ddp'] / 2**20:.0f} MiB = {summary['fsdp_state_over_ddp']}"
        f" (goal <= {summary['fsdp_state_goal']}); peak RSS MiB {summary['peak_rss_mib']}"
    )
    for v, s in summary["saves"].items():
        print(
            f"  {v} save: sync {s['sync_stall_s']} s; async stall {s['async_stall_s']} s"
            f" = {s['async_stall_over_sync']} of sync (goal <= {ASYNC_STALL_GOAL}; the run's first async save"
            f" {s['async_first_stall_s']} s = {s['async_first_stall_over_sync']}), in place after"
            f" {s['async_done_s']} s; bytes per rank {s['bytes_per_rank']}"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
