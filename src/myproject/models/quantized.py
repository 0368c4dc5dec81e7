"""A frozen base in 4 bits: QLoRA (`model.base.quantization=nf4`), with torchao's NF4 as torchtune uses it.

Each linear layer of the base whose weight is frozen is stored as NF4 (4-bit normal-float codes in blocks of
64 values, their scales quantized again in blocks of up to 256): about a quarter of the bfloat16 bytes. Its
forward dequantizes the weight to the input's dtype and multiplies (`torchao`'s linear_nf4); the adapters
(and the embeddings, the norms and the output layer) keep their dtype, so they train as without it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hpctrain import UserError

BLOCK = 64  # values per scale
SCALER_BLOCK = 256  # scales per second-level scale, at most


def check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise UserError(
            "model.base.quantization=nf4 needs torchao, which is not installed; pip install -e '.[llm]' "
            "(or pass model.base.quantization=null)."
        )


def to_nf4(network: nn.Module) -> int:
    """Store every frozen nn.Linear weight of `network` (the output layer aside) as NF4; returns how many.
    A weight whose size is not a multiple of 64 values stays as it is."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as nf4

    done = 0
    for name, module in network.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head" or weight.requires_grad:
            continue
        if weight.numel() % BLOCK or is_quantized(weight):
            continue
        scalers = math.gcd(SCALER_BLOCK, weight.numel() // BLOCK)
        module.weight = nn.Parameter(nf4(weight.detach(), BLOCK, scalers), requires_grad=False)
        done += 1
    return done


def dequantized(network: nn.Module) -> int:
    """Every NF4 weight of `network` back in its dtype (the values the model computed with); how many."""
    done = 0
    for module in network.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and is_quantized(weight):
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
            done += 1
    return done


def is_quantized(weight: torch.Tensor | None) -> bool:
    return callable(getattr(weight, "get_original_weight", None))
