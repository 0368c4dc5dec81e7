"""A Hugging Face causal language model fine-tuned with LoRA adapters (PEFT): `model=causal_lm_lora`.

The base is a local Hugging Face folder (`base.path`: config.json, *.safetensors, the tokenizer; with
`base.stage_dir`, copied to node-local disk once per node first), or a new architecture from its config
(`base.config`, random weights: tests and benchmarks). A base from a
folder is built empty (`hpctrain.empty_weights`) and its files named in `pretrained_files()`: hpctrain
reads them once the model is built, or under FSDP2 each rank its own shards once it is sharded, so no
process ever holds a whole large base it does not need. The base is frozen; only the adapters train
(the optimizer gets them alone), and with `checkpoints.trainable_only` (auto: when most parameters are
frozen) checkpoints store the adapters and their optimizer state only.

Batches are those of `data=instructions` (`hpctrain.data.TokenizedDataModule`): the loss is taken on the
tokens whose label is not -100 (the assistant's, or all), next-token shifted, and weighted by token over
the whole optimizer step, as TRL and transformers (>= 4.46) weight it: every token of every micro-batch of
`trainer.accumulate_grad_batches` on every rank counts the same, however the tokens fall into batches
(`on_before_optimizer_step`). With the data's
`packing=concat` (`packing`), the examples packed in a row (their positions restart at 0 where each
begins) attend only inside themselves.

Written with `import lightning as L`, as Lightning's documentation and most language-model code write it:
its runs train under the `lightning` package's Trainer, and everything hpctrain adds to them (FSDP2, the
checkpoint callbacks, `data=instructions`) is of that package (the image examples are written with
`import pytorch_lightning as pl`; either runs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.optim import Optimizer

from hpctrain import UserError, empty_weights
from hpctrain.data import stage_folder
from myproject.models import optim, quantized
from myproject.models.metrics import Mean

IGNORE = -100
GENERATION = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0}
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CausalLMLoRA(L.LightningModule):
    def __init__(
        self,
        base: dict[str, Any],
        lora: dict[str, Any],
        optimizer: Callable[..., Optimizer],
        scheduler: Callable[..., Any] | None = None,
        scheduler_interval: str = "step",
        packing: str = "none",
        max_length: int | None = None,
        generation: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        # imported here: the llm extra is optional, and the quick tier composes every model
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        self.quantization = base.get("quantization")
        if self.quantization not in (None, "nf4"):
            raise UserError(
                f"model.base.quantization={self.quantization} is not one of nf4, null; pass "
                "model.base.quantization=nf4 (QLoRA: the frozen base in 4 bits) or null."
            )
        if self.quantization:
            quantized.check_installed()
        self.base_path = _base_folder(base)
        dtype = getattr(torch, str(base.get("dtype") or "float32"))
        if self.base_path is not None:
            source = self.base_path
            if base.get("stage_dir"):  # read from node-local disk: copied there once per node
                self.base_path = str(stage_folder(source, base["stage_dir"]))
            # never the folder's own Python code (a config's auto_map), never a question on the terminal
            config = AutoConfig.from_pretrained(self.base_path, trust_remote_code=False)
            config.name_or_path = source  # what an exported adapter names as its base: the shared folder
            with empty_weights():  # read from its files by hpctrain (pretrained_files)
                network = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            fields = dict(base["config"])
            config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
            network = AutoModelForCausalLM.from_config(config, dtype=dtype)
        network.config.use_cache = False  # training: no key/value cache (generate turns it on for itself)
        if (
            gradient_checkpointing
        ):  # each decoder layer's activations recomputed in the backward, any strategy
            network.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _check_positions(max_length, network.config)
        targets = lora.get("target_modules", "all-linear")
        _check_targets(targets, network)
        self.net = get_peft_model(
            network,
            LoraConfig(
                r=int(lora.get("r", 8)),
                lora_alpha=int(lora.get("alpha", 16)),
                lora_dropout=float(lora.get("dropout", 0.0)),
                target_modules=targets if isinstance(targets, str) else list(targets),
                task_type="CAUSAL_LM",
            ),
        )
        _initialise_adapters(self.net)
        if self.quantization and self.base_path is None:  # a new architecture: its weights exist already
            self._quantize()
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.packed = packing == "concat"  # rows of several examples: attention kept inside each
        self.val_loss = Mean()
        self.step_sums: Tensor | None = None  # this rank's loss sum and token count since the last step
        self.generation = {**GENERATION, **(generation or {})}

    def pretrained_files(self) -> dict[str, tuple[str, str]]:
        """{parameter: (safetensors file, tensor name)} of the base's weights (read by hpctrain)."""
        if self.base_path is None:
            return {}
        folder = Path(self.base_path)
        index = folder / SAFETENSORS_INDEX
        if index.is_file():
            where = {k: str(folder / f) for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            single = folder / "model.safetensors"
            with safe_open(str(single), framework="pt") as stored:
                where = {k: str(single) for k in stored.keys()}  # noqa: SIM118 (a safetensors handle)
        prefix = (
            self.net.get_base_model().base_model_prefix + "."
        )  # GPT-2's files name h.0..., not transformer.h.0...
        files = {}
        for name, _ in self.named_parameters():
            key = name.removeprefix("net.base_model.model.").replace(".base_layer.", ".")
            key = key if key in where else key.removeprefix(prefix)
            if key in where:
                files[name] = (where[key], key)
        return files

    def pretrained_loaded(self) -> None:
        """Called by hpctrain once the base's values are read: with model.base.quantization=nf4, its
        frozen linear layers in 4 bits (myproject.models.quantized)."""
        if not self.quantization:
            return
        if _sharded(self.net):
            raise UserError(
                "model.base.quantization=nf4 quantizes the base once it is read whole, but under FSDP2 "
                "(trainer.strategy=fsdp) each rank reads only its shards; train it with trainer=cpu, ddp_cpu "
                "or ddp (each process holding the 4-bit base), or pass model.base.quantization=null."
            )
        self._quantize()

    def _quantize(self) -> None:
        quantized.to_nf4(self.net)
        # DDP copies every parameter from rank 0 as it wraps the module (torch's private list of those it
        # leaves out: tests/test_llm_bases.py fails if it goes), and a 4-bit weight copied in is
        # quantized again, not kept: every process quantized the same values already
        from torch.nn.parallel import DistributedDataParallel

        four_bits = [n for n, p in self.named_parameters() if quantized.is_quantized(p)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, four_bits)

    def dequantize(self) -> int:
        """The base's 4-bit weights back in their dtype, the values it computed with (an export writes
        those); how many layers were quantized."""
        return quantized.dequantized(self.net)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, vocab)."""
        mask = attention_mask
        if self.packed and position_ids is not None and attention_mask is not None:
            mask = _inside_examples(position_ids, attention_mask)
        return self.net(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The next-token cross-entropy summed over the tokens that count, and how many count."""
        logits = self(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
        # each position's next token (the last position predicts none): the logits are read as they are,
        # not copied into a shifted view
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)
        count = (targets != IGNORE).sum()
        total = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return total, count

    def flops_per_batch(self, batch: dict[str, Tensor]) -> float:
        """A training step's FLOPs on `batch` (read by the performance callback for the MFU), as PaLM counts
        a transformer's: per token, 2 per weight forward and 2 backward (to the inputs), 2 more for the
        weights that train (the adapters; the frozen base gets no weight gradient), and 12 * layers * width
        * context for attention; the tokens are those of the batch that are not padding."""
        config = self.net.get_base_model().config
        weights = [p for n, p in self.named_parameters() if "embed_tokens" not in n]  # a lookup, no FLOPs
        every = sum(p.numel() for p in weights)
        trainable = sum(p.numel() for p in weights if p.requires_grad)
        tokens = int(batch["attention_mask"].sum())
        context = batch["input_ids"].shape[1]
        attention = 12 * config.num_hidden_layers * config.hidden_size * context
        return float(tokens * (4 * every + 2 * trainable + attention))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The loss summed over this micro-batch's tokens: Lightning divides it by accumulate_grad_batches,
        and DDP and FSDP2 average its gradients over the ranks; `on_before_optimizer_step` then divides
        the gradients by the step's tokens instead."""
        total, count = self.loss(batch)
        sums = torch.stack([total.detach(), count.to(total.dtype)])
        self.step_sums = sums if self.step_sums is None else self.step_sums + sums
        return total

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Every micro-batch of the step on every rank has added its gradient: scale them to the gradient
        of the mean over the step's tokens, all ranks together (one all-reduce of two numbers, on the
        device: no rank waits on the host), and log that mean as train/loss."""
        if self.step_sums is None:
            return
        trainer = self.trainer
        loss_sum, tokens = trainer.strategy.reduce(self.step_sums, reduce_op="sum").unbind()
        tokens = tokens.clamp(min=1)
        scale = trainer.world_size * trainer.accumulate_grad_batches / tokens
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)
        self.log("train/loss", loss_sum / tokens)  # written every trainer.log_every_n_steps steps
        self.step_sums = None

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        total, count = self.loss(batch)
        self.val_loss.update(total / count.clamp(min=1), count)  # weighted by the tokens that count

    def on_validation_epoch_end(self) -> None:
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/perplexity", math.exp(min(float(self.val_loss.compute()), 50.0)), sync_dist=True)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, str]]:
        """src/predict.py: an answer to each prompt of the batch (left-padded: myproject.data.prompts), up
        to `generation.max_new_tokens` or the end-of-turn token; greedy at temperature 0, else sampled with
        `top_p`, from `seed`, the batch and the rank (the same command gives the same answers). Every rank
        generates until the last one is done (`synced_gpus`): under FSDP2 each step gathers parameters."""
        tokenizer = self.trainer.datamodule.tokenizer  # type: ignore[attr-defined]
        settings = self.generation
        sampled = float(settings["temperature"]) > 0
        torch.manual_seed(int(settings["seed"]) + 100_003 * batch_idx + self.global_rank)
        with torch.no_grad():
            out = self.net.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=int(settings["max_new_tokens"]),
                do_sample=sampled,
                temperature=float(settings["temperature"]) if sampled else None,
                top_p=float(settings["top_p"]) if sampled else None,
                top_k=0 if sampled else None,  # top_p alone decides what is sampled
                use_cache=True,
                synced_gpus=_sharded(self.net),  # no rank waits for another's parameters forever
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id
                if tokenizer.pad_token_id is not None
                else tokenizer.eos_token_id,
            )
        answers = out[:, batch["input_ids"].shape[1] :]
        return [
            {"prompt": prompt, "completion": tokenizer.decode(answer, skip_special_tokens=True)}
            for prompt, answer in zip(batch["prompt"], answers, strict=True)
        ]

    def configure_optimizers(self) -> Any:
        """Every parameter, in the module's order: the frozen base never has a gradient, so the optimizer
        steps and keeps state for the adapters alone, and its state is numbered as the module's parameters
        are (a checkpoint of one strategy then continues under another: FSDP2 names the states by that
        numbering)."""
        return optim.configure(
            self, self.parameters(), self.optimizer_factory, self.scheduler_factory, self.scheduler_interval
        )


def _sharded(network: torch.nn.Module) -> bool:
    """Whether the parameters are sharded across processes (FSDP2: every forward gathers them)."""
    return any(callable(getattr(p, "full_tensor", None)) for p in network.parameters())


def _check_positions(max_length: int | None, config: Any) -> None:
    positions = getattr(config, "max_position_embeddings", None)
    if max_length is not None and positions is not None and max_length > positions:
        raise UserError(
            f"data.max_length={max_length} is beyond the base's {positions} positions (max_position_embeddings "
            f"in its config.json); pass data.max_length={positions} or less."
        )


def _linear_layers(network: torch.nn.Module) -> dict[str, list[str]]:
    """{last part of the name: full names} of the layers LoRA can adapt (nn.Linear, GPT-2's Conv1D), the
    output layer aside, as PEFT's all-linear leaves it."""
    from transformers.pytorch_utils import Conv1D

    found: dict[str, list[str]] = {}
    for name, module in network.named_modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)) and name.split(".")[-1] != "lm_head":
            found.setdefault(name.split(".")[-1], []).append(name)
    return found


def _check_targets(targets: str | list[str], network: torch.nn.Module) -> None:
    """Every name of model.lora.target_modules adapts some layer (PEFT's rule: a full name, or its last
    parts); a regular expression matches some layer; else one sentence naming the model's linear layers."""
    import re

    layers = _linear_layers(network)
    names = [name for names in layers.values() for name in names]
    if isinstance(targets, str):
        if targets == "all-linear" or any(re.fullmatch(targets, n) for n in names):
            return
        unmatched = [targets]
    else:
        unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched:
        raise UserError(
            f"model.lora.target_modules: {', '.join(map(str, unmatched))} names no linear layer of "
            f"{type(network).__name__}, whose linear layers are {', '.join(layers)}; pass some of them, e.g. "
            f"model.lora.target_modules=[{','.join(list(layers)[:2])}], or all-linear."
        )


def _base_folder(base: dict[str, Any]) -> str | None:
    path, config = base.get("path"), base.get("config")
    if (path is None) == (config is None):
        raise UserError(
            f"model.base.path={path} and model.base.config={'set' if config else None}: give exactly one, "
            "a local Hugging Face folder (config.json, *.safetensors, the tokenizer) or an architecture's config."
        )
    if path is None:
        return None
    folder = Path(str(path)).expanduser()
    if base.get("demo") and not (folder / "config.json").is_file():  # experiment=lora_sft: made offline
        from hpctrain.data import made_once
        from myproject.data import tiny_llm

        made_once(folder.parent, tiny_llm.make, marker=f"{folder.name}/config.json")
    if not (folder / "config.json").is_file():
        what = "holds no config.json" if folder.is_dir() else "does not exist"
        raise UserError(
            f"model.base.path={folder} {what}; pass a local Hugging Face model folder (config.json, "
            "*.safetensors and the tokenizer files, e.g. as huggingface-cli download writes it)."
        )
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        held = f"holds {', '.join(pickled[:2])} only" if pickled else "holds no *.safetensors"
        raise UserError(
            f"model.base.path={folder} {held}, a format this template does not read (a pickle runs code when "
            "loaded); convert it once where you trust the file: AutoModelForCausalLM.from_pretrained(folder)"
            ".save_pretrained(new_folder) writes model.safetensors, then pass model.base.path=<new_folder>."
        )
    _check_own_code(folder)
    return str(folder)


def _check_own_code(folder: Path) -> None:
    """A config.json whose auto_map names the folder's own Python: transformers' implementation of its
    model_type is used where transformers has one (the folder's code never runs, as with
    trust_remote_code=False); without one the base is refused, never run and never asked about."""
    from transformers import CONFIG_MAPPING

    config = json.loads((folder / "config.json").read_text())
    if "auto_map" in config and config.get("model_type") not in CONFIG_MAPPING:
        raise UserError(
            f"model.base.path={folder} asks to run its own Python code (auto_map in config.json, model_type "
            f"{config.get('model_type')!r}, which transformers does not implement); this template never runs "
            "code from a model folder: use a base of an architecture transformers implements."
        )


def _initialise_adapters(network: torch.nn.Module) -> None:
    """PEFT puts each adapter on its base layer's device; a base built empty (the meta device) leaves the
    adapters empty too, so they get memory here and PEFT's own initialisation (A random, B zero)."""
    from peft.tuners.lora import LoraLayer

    for module in network.modules():
        if isinstance(module, LoraLayer):
            for name in module.active_adapters:
                layers = [layer[name] for layer in (module.lora_A, module.lora_B) if name in layer]
                if any(p.is_meta for layer in layers for p in layer.parameters()):
                    for layer in layers:
                        layer.to_empty(
                            device=torch.empty(0).device
                        )  # the default device (meta in a meta copy)
                    module.reset_lora_parameters(name, True)


def _inside_examples(position_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """A (B, 1, T, T) mask: each token attends to the earlier tokens of its own example (and to itself)."""
    example = torch.cumsum((position_ids == 0).long(), dim=1)
    same = example[:, :, None] == example[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    valid = attention_mask.bool()[:, None, :]
    itself = torch.eye(length, dtype=torch.bool, device=position_ids.device)
    return ((same & causal & valid) | itself)[:, None]
