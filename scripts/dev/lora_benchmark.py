"""LoRA fine-tuning on CPU: `experiment=lora_sft` against a bare loop of the same model, side by side in one
run (its figures: docs/benchmarks/2026-11-29-lora-cpu.md).

    python scripts/dev/lora_benchmark.py                      # a ~50 M-parameter Llama-shaped base, 1 process
    python scripts/dev/lora_benchmark.py --tiny --json out.json

Two variants train the same architecture (its config given as model.base.config, the same random
weights: seed 0), the same LoRA adapters (r=8 on q_proj and v_proj) and AdamW, on the same batches (the
demo's instructions, tokenized once by the template's datamodule), each in a process of its own (so the
peak RSS is the variant's), the three at once but taking turns step by step (a baton passed round a ring
of pipes: one process steps while the others wait, asleep), so that whatever else the machine runs slows
them alike; `--rounds` rounds:

  template   src/train.py's path: the composed config, build.trainer with its default callbacks (loggers
             off), the model=causal_lm_lora module (token-weighted loss, the all-reduce of its counts)
  bare       transformers + peft + torch's AdamW in a plain loop over the same batches, already in
             memory (so the template's data loading counts against it), the loss as transformers takes
             it (`num_items_in_batch`)
  qlora      the template with model.base.quantization=nf4: the frozen base's linear layers in 4 bits

Per variant: tokens a loss was taken on per second, the median over the steps after `--warmup` of each
step's rate (host clock, from taking the baton to the step's end: the template's loading of the batch,
its hooks and logging included), the peak RSS of the process while it trained (VmHWM, reset when
training starts), and the bytes its parameters hold (4-bit weights as stored). The ratio template/bare is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT / "scripts" / "dev"))
from fsdp_benchmark import _peak_rss_mib, _reset_peak  # noqa: E402

PYTHON = sys.executable
VARIANTS = ("template", "bare", "qlora")
GOAL = 0.97  # template/bare tokens per second, at least
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
LR = 0.003


def base_config(args: argparse.Namespace) -> dict:
    """A Llama-shaped base: ~50 M parameters at the defaults (tied embeddings of a 32 k vocabulary)."""
    return {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": args.width,
        "intermediate_size": args.width * 3,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    }


def overrides(args: argparse.Namespace, data_dir: str, out: str) -> list[str]:
    config = json.dumps(base_config(args)).replace('"', "").replace(" ", "")
    four_bits = ["model.base.quantization=nf4"] if args.variant == "qlora" else []
    return [
        *four_bits,
        "experiment=lora_sft",
        "trainer=cpu",
        "model.base.path=null",
        f"model.base.config={config}",
        "data.tokenizer=${paths.data_dir}/tiny_llm/base",  # the demo's tokenizer; the base from its config
        f"model.lora.r={LORA['r']}",
        f"model.lora.alpha={LORA['alpha']}",
        f"model.lora.dropout={LORA['dropout']}",
        f"model.optimizer.lr={LR}",
        "model/scheduler=none",
        f"data.batch_size={args.batch_size}",
        f"data.max_length={args.max_length}",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.max_epochs=null",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        "callbacks.chat_sample=null",
        f"paths.data_dir={data_dir}",
        f"paths.output_dir={out}",
        f"paths.log_dir={out}",
        "seed=0",
    ]


def parameter_bytes(module) -> int:
    """The bytes the module's parameters hold (a 4-bit weight's codes and scales, as stored)."""
    inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    total = 0
    for p in module.parameters():
        parts = [getattr(p, k) for k in inner] if hasattr(p, "quantized_data") else [p]
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


class Turns:
    """This process's turn in the ring: `take` waits (asleep) for the baton, `give` passes it on; each
    step's seconds run from taking the baton to the step's end."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.inbox, self.outbox = os.open(args.baton_in, os.O_RDWR), os.open(args.baton_out, os.O_RDWR)
        self.ready = os.open(Path(args.baton_in).with_name("ready"), os.O_RDWR)
        self.total = args.warmup + args.steps
        self.seconds: list[float] = []
        self.counted: list[int] = []
        self._started = 0.0

    def start(self) -> None:
        """Ready to train (its model built, its data read); the first turn comes once every process is."""
        os.write(self.ready, b"r")
        self.take()

    def take(self) -> None:
        os.read(self.inbox, 1)
        self._started = time.perf_counter()

    def step_done(self, tokens_counted: int) -> None:
        self.seconds.append(time.perf_counter() - self._started)
        self.counted.append(tokens_counted)
        os.write(self.outbox, b"x")
        if len(self.seconds) < self.total:
            self.take()

    def figures(self, warmup: int) -> dict:
        """The median over the steps after the warm-up of each step's tokens per second, and the mean."""
        rates = [n / t for n, t in zip(self.counted[warmup:], self.seconds[warmup:], strict=True)]
        mean = sum(self.counted[warmup:]) / sum(self.seconds[warmup:])
        return {"tokens_per_s": statistics.median(rates), "mean_tokens_per_s": mean, "steps": len(rates)}


def run_template(args: argparse.Namespace, cfg, settings, found: dict) -> None:
    import lightning as L

    from hpctrain.runtime.run import build

    turns = Turns(args)

    class Measure(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            found["parameter_mib"] = parameter_bytes(pl_module) / 2**20
            _reset_peak()
            turns.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            turns.step_done(tokens(batch))  # and waits for its next turn, the rest of this batch's work in it

        def on_train_end(self, trainer, pl_module) -> None:
            found.update(turns.figures(args.warmup), peak_rss_mib=_peak_rss_mib())

    trainer = build.trainer(cfg, settings, cfg.paths.output_dir, logger=[])
    trainer.callbacks.append(Measure())
    trainer.fit(build.model(cfg), build.datamodule(cfg, settings))


def run_bare(args: argparse.Namespace, cfg, settings, found: dict) -> None:
    import torch
    from hydra.utils import instantiate
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    data = instantiate(cfg.data, _convert_="all")
    data.check_available()
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():  # the template's batches, in its order, held in memory
        batches.append(batch)
        if len(batches) == args.warmup + args.steps:
            break
    fields = base_config(args)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    base.config.use_cache = False
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules=LORA["target_modules"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    turns = Turns(args)
    found["parameter_mib"] = parameter_bytes(model) / 2**20
    _reset_peak()
    turns.start()
    for batch in batches:
        count = tokens(batch)
        loss = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            num_items_in_batch=count,
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        turns.step_done(count)
    found.update(turns.figures(args.warmup), peak_rss_mib=_peak_rss_mib())


def worker(args: argparse.Namespace) -> None:
    """One variant in this process; prints its figures."""
    from hpctrain.runtime.config.compose import compose
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.run import build

    cfg = compose("train", overrides(args, args.data_dir, tempfile.mkdtemp(prefix="lora-benchmark-")))
    settings = Settings.of(cfg)
    build.configure_process(cfg, settings)  # the same threads per process for both
    found: dict = {}
    (run_bare if args.variant == "bare" else run_template)(args, cfg, settings, found)
    print("RESULT " + json.dumps(found), flush=True)


def _round(args: argparse.Namespace, data_dir: str, env: dict) -> dict:
    """The three variants at once, in processes of their own, taking turns step by step."""
    ring = Path(tempfile.mkdtemp(prefix="lora-benchmark-ring-"))
    boxes = [ring / f"baton-{i}" for i in range(len(VARIANTS))]
    for box in boxes:
        os.mkfifo(box)
    os.mkfifo(ring / "ready")
    held = [os.open(box, os.O_RDWR) for box in [*boxes, ring / "ready"]]  # open while the workers come and go
    workers = []
    for i, variant in enumerate(VARIANTS):
        command = [PYTHON, str(Path(__file__).resolve()), "--worker", "--variant", variant,
                   "--data-dir", data_dir, "--layers", str(args.layers), "--width", str(args.width),
                   "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--baton-in", str(boxes[i]), "--baton-out", str(boxes[(i + 1) % len(boxes)])]  # fmt: skip
        out = open(ring / f"{variant}.log", "w")  # noqa: SIM115 (closed once the worker ends)
        workers.append(
            (variant, subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env), out)
        )
    for _ in VARIANTS:  # none steps while another still builds its model: the first turn once all are ready
        os.read(held[-1], 1)
    os.write(held[0], b"x")
    found = {}
    for variant, process, out in workers:
        process.wait(timeout=3600)
        out.close()
        text = (ring / f"{variant}.log").read_text()
        match = re.search(r"^RESULT (.*)$", text, re.MULTILINE)
        if process.returncode != 0 or not match:
            print(text[-4000:], file=sys.stderr)
            sys.exit(1)
        found[variant] = json.loads(match.group(1))
    for fd in held:
        os.close(fd)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--baton-in", help=argparse.SUPPRESS)
    parser.add_argument("--baton-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.width, args.steps, args.warmup, args.rounds = 2, 64, 4, 2, 1
    if args.worker:
        worker(args)
        return
    data_dir = tempfile.mkdtemp(prefix="lora-benchmark-data-")  # the demo's data, tokenized by the first run
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    rounds: list[dict] = []
    for round_ in range(args.rounds):
        found = _round(args, data_dir, env)
        found["ratio"] = found["template"]["tokens_per_s"] / found["bare"]["tokens_per_s"]
        rounds.append(found)
        print(
            f"  round {round_ + 1}: template {found['template']['tokens_per_s']:.0f} tokens/s, bare "
            f"{found['bare']['tokens_per_s']:.0f} tokens/s: {found['ratio']:.3f}; qlora "
            f"{found['qlora']['tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
    fields = base_config(args)
    width, layers, vocab = fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]
    parameters = layers * (4 * width**2 + 3 * width * fields["intermediate_size"]) + vocab * width
    summary = {
        "parameters": parameters,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "steps": args.steps,
        "rounds": args.rounds,
        "tokens_per_s": {
            v: round(statistics.median(r[v]["tokens_per_s"] for r in rounds), 1) for v in VARIANTS
        },
        "peak_rss_mib": {
            v: round(statistics.median(r[v]["peak_rss_mib"] for r in rounds), 1) for v in VARIANTS
        },
        "parameter_mib": {v: round(rounds[0][v]["parameter_mib"], 1) for v in VARIANTS},
        "template_over_bare": round(statistics.median(r["ratio"] for r in rounds), 3),
        "goal": GOAL,
    }
    print(
        f"LoRA on CPU, a {parameters / 1e6:.0f} M-parameter base, 1 process: tokens/s {summary['tokens_per_s']}, "
        f"peak RSS MiB {summary['peak_rss_mib']}, parameters MiB {summary['parameter_mib']}; template/bare {summary['template_over_bare']} (goal >= {GOAL})"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
