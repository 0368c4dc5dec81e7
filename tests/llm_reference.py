"""A run of model=causal_lm_lora replayed outside the template: transformers' own forward and loss
(`labels`, `num_items_in_batch`: the sum over the step's tokens, as its Trainer and TRL take it), peft's
LoRA and torch's optimizer, on the batches the run recorded (tests/llm_code.py: RecordSteps), from the
adapters it started with. Nothing of the template's model, loss or data code is imported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

IGNORE = -100


def tokens(batch: dict[str, Tensor]) -> int:
    """The tokens a loss is taken on: labels other than -100, next-token shifted."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def one_batch(batches: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The examples of several batches in one, right-padded (masked, no label) to the longest."""
    length = max(b["input_ids"].shape[1] for b in batches)

    def pad(t: Tensor, value: int) -> Tensor:
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)

    return {
        "input_ids": torch.cat([pad(b["input_ids"], 0) for b in batches]),
        "attention_mask": torch.cat([pad(b["attention_mask"], 0) for b in batches]),
        "labels": torch.cat([pad(b["labels"], IGNORE) for b in batches]),
    }


def base(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def _summed(model: Any, batch: dict[str, Tensor], items: int) -> Tensor:
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        num_items_in_batch=items,
    )
    return out.loss


def val_loss(folder: Path, batches: list[dict[str, Tensor]]) -> float:
    """transformers' loss of the base over every token of `batches` that counts, each token once."""
    model = base(folder).eval()
    count = sum(tokens(b) for b in batches)
    with torch.no_grad():
        return float(sum(_summed(model, b, count).double() for b in batches))


def adapted(folder: Path, lora: dict[str, Any], start: dict[str, Tensor]) -> Any:
    """The base with peft's LoRA, its adapters set to the run's at its start (`net.`-prefixed names)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        base(folder),
        LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=0.0,
            target_modules=lora["target_modules"],
            task_type="CAUSAL_LM",
        ),
    )
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable == {n.removeprefix("net.") for n in start}, "the run's adapters are not peft's"
    with torch.no_grad():
        for name, value in start.items():
            named[name.removeprefix("net.")].copy_(value)
    return model


def trainable(model: Any) -> dict[str, Tensor]:
    return {f"net.{n}": p for n, p in model.named_parameters() if p.requires_grad}


def gradient(model: Any, batches: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The gradient of the mean loss over every token of `batches`, taken as one batch."""
    model.train()
    model.zero_grad()
    together = one_batch(batches)
    _summed(model, together, tokens(together)).backward()
    return {n: p.grad.detach().clone() for n, p in trainable(model).items()}


def replay(model: Any, steps: list[list[dict[str, Tensor]]], optimizer: torch.optim.Optimizer) -> list[float]:
    """One optimizer step per item of `steps` (its micro-batches, all ranks'), the loss divided by the
    step's tokens; returns each step's loss."""
    model.train()
    losses = []
    for micro in steps:
        optimizer.zero_grad()
        count = sum(tokens(b) for b in micro)
        total = torch.zeros((), dtype=torch.float64)
        for batch in micro:
            loss = _summed(model, batch, count)
            loss.backward()
            total += loss.detach().double()
        optimizer.step()
        losses.append(float(total))
    return losses


def steps_of(records: list[dict[str, Any]], accumulate: int) -> list[list[dict[str, Tensor]]]:
    """The micro-batches of each optimizer step, every rank's (`records` by rank)."""
    count = len(records[0]["train"]) // accumulate
    return [
        [b for r in records for b in r["train"][s * accumulate : (s + 1) * accumulate]] for s in range(count)
    ]


def read(folder: Path) -> tuple[list[dict[str, Any]], dict[int, dict[str, Tensor]]]:
    """What RecordSteps wrote: each rank's record, and the trainable parameters by optimizer step."""
    ranks = sorted(folder.glob("rank*.pt"), key=lambda p: int(p.stem.removeprefix("rank")))
    params = {int(p.stem.split("-")[1]): torch.load(p, weights_only=True) for p in folder.glob("params-*.pt")}
    return [torch.load(p, weights_only=True) for p in ranks], params
