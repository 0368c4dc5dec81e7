"""A callback that shows what a fine-tuned chat model answers: a short sample after each validation.

Written with `import lightning as L`, as the model it samples (`myproject.models.causal_lm`).
"""

from __future__ import annotations

import logging

import lightning as L
import torch

log = logging.getLogger(__package__.split(".")[0])


class ChatSample(L.Callback):
    """After every validation (not the sanity check), answer `prompt` with the model being trained: the
    prompt rendered with the data's tokenizer and its chat template, then sampled up to `max_new_tokens`
    or the end-of-turn token; where the tokenizer has no chat template (a base trained on plain text), the
    prompt as plain text, continued. Rank 0's answer is logged (`last` on every rank holds its own).

    Every rank generates, each with its own draws (a seed of the epoch and the rank), so ranks stop at
    different steps: under FSDP2 each step gathers parameters from every rank, and `synced_gpus` keeps a
    rank that has finished stepping (its output unchanged) until the last one has, so no rank waits
    forever. The training's random state is left as it was."""

    def __init__(
        self, prompt: str, max_new_tokens: int = 32, temperature: float = 0.8, top_k: int | None = 20
    ) -> None:
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.temperature, self.top_k = temperature, top_k
        self.last: str | None = None
        self.new_tokens: int | None = None  # how many this rank generated last time

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tokenizer = trainer.datamodule.tokenizer  # type: ignore[attr-defined]
        chat = bool(tokenizer.chat_template)
        if chat:
            encoded = tokenizer.apply_chat_template(
                [{"role": "user", "content": self.prompt}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )
        else:
            encoded = tokenizer(self.prompt, return_tensors="pt")
        prompt = encoded["input_ids"].to(pl_module.device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        net = pl_module.net
        was_training = net.training
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(1000 * trainer.current_epoch + trainer.global_rank)
            net.eval()
            out = net.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=self.max_new_tokens,
                do_sample=True,
                temperature=self.temperature,
                top_k=self.top_k,
                use_cache=True,
                synced_gpus=trainer.world_size > 1,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad,
            )
        net.train(was_training)
        answer = out[0, prompt.shape[1] :]
        self.new_tokens = int(answer.numel())
        self.last = tokenizer.decode(answer, skip_special_tokens=True)
        if trainer.is_global_zero:
            kind = "" if chat else " (plain text: the tokenizer has no chat template)"
            log.info("sample after epoch %d%s: %s -> %s", trainer.current_epoch, kind, self.prompt, self.last)
