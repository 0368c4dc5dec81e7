"""Start a new run from weights: `init_from.path=<file>` (a fresh optimizer, epoch 0, its own run dir).

The file may be a checkpoint of this template or of any Lightning project (its `state_dict`), a plain
torch state dict (`.pt`/`.pth`, e.g. torchvision's pretrained weights copied to an offline cluster) or
a `.safetensors` file (with the safetensors package). Loaded with `weights_only=True`: never pickled code.

- `init_from.prefix`: put in front of every key (`net.` maps a bare network's keys into the classifier);
- `init_from.exclude`: regular expressions of keys to leave out (a new classification head);
- `init_from.strict` (default true): any missing, unexpected or reshaped key is one sentence listing
  the first few of each, with counts; false loads every key whose name and shape match and says in
  one line what was skipped;
- `init_from.freeze`: regular expressions of parameter names to freeze; the BatchNorm layers inside a
  frozen part keep their statistics too (they stay in eval mode while training);
- `init_from.unfreeze_at_epoch`: train the frozen part too from this epoch on (correct under DDP: see
  `hpctrain.callbacks.frozen_parts.FrozenParts`).

A requeued attempt of the same job continues from its own checkpoint; init_from is skipped there (said
once), never applied on top. Given together with `ckpt_path` it is refused: one or the other.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import sharded
from hpctrain.runtime.storage.checkpoints.reading import read

log = logging.getLogger("hpctrain")


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """The tensors in `path`, whatever kind of weights file it is (see the module docstring)."""
    path = Path(path).expanduser()
    if path.is_dir():  # a sharded checkpoint folder (FSDP2): checked, then its whole model read
        return read(path, "init_from.path")["state_dict"]
    if not path.is_file():
        raise UserError(
            f"init_from.path={path} does not exist; pass a checkpoint, a .pt/.pth state dict or a .safetensors file."
        )
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise UserError(
                f"init_from.path={path} is a safetensors file, but the safetensors package is not installed; "
                "pip install safetensors."
            ) from err
        return load_file(str(path))
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        content = read(path, "init_from.path")  # a checkpoint that read() can explain in one sentence
    if isinstance(content, dict) and isinstance(content.get("state_dict"), dict):
        content = content["state_dict"]  # a Lightning checkpoint, this template's or another project's
    if not (isinstance(content, dict) and content and all(isinstance(v, Tensor) for v in content.values())):
        raise UserError(
            f"init_from.path={path} holds neither a state dict nor a Lightning checkpoint; save the weights "
            "with torch.save(model.state_dict(), path)."
        )
    return content


def check_readable(path: str | Path) -> None:
    """`path` as `read_weights` reads it, without reading a sharded folder's weights (its index, shard
    files and non-tensor items are checked) or a file's tensors (memory-mapped)."""
    path = Path(path).expanduser()
    if path.is_dir():
        sharded.check_folder(path, "init_from.path")
    elif path.suffix != ".safetensors":  # safetensors holds tensors only: nothing to check before reading
        read_weights(path)


def _listed(keys: Sequence[str], what: str, show: int = 3) -> str:
    return f"{len(keys)} {what} ({', '.join(keys[:show])}{', ...' if len(keys) > show else ''})"


def apply(
    module: nn.Module, path: str | Path, strict: bool = True, exclude: Sequence[str] = (), prefix: str = ""
) -> str:
    """Load the weights of `path` into `module` as configured; returns the line that says what was loaded."""
    weights = {f"{prefix}{k}": v for k, v in read_weights(path).items()}
    dropped = [k for k in weights if any(re.search(p, k) for p in exclude)]
    for key in dropped:
        del weights[key]
    # A new run's metrics start empty: a persistent metric state in the file (val_acc_best, say) belongs
    # to the run that wrote it, and would otherwise make the new run's first epochs look worse than "best".
    metrics = tuple(f"{name}." for name, m in module.named_modules() if isinstance(m, Metric) and name)
    expected = {k: v for k, v in module.state_dict().items() if not k.startswith(metrics)}
    weights = {k: v for k, v in weights.items() if not k.startswith(metrics)}
    missing = sorted(k for k in expected if k not in weights and not any(re.search(p, k) for p in exclude))
    unexpected = sorted(k for k in weights if k not in expected)
    reshaped = sorted(
        f"{k} {list(weights[k].shape)} vs {list(expected[k].shape)}"
        for k in weights
        if k in expected and weights[k].shape != expected[k].shape
    )
    problems = [
        _listed(keys, what)
        for keys, what in ((missing, "missing"), (unexpected, "unexpected"), (reshaped, "of another shape"))
        if keys
    ]
    if strict and problems:
        raise UserError(
            f"init_from.path={path} does not fit the model: {'; '.join(problems)}; map a bare network's keys "
            "with init_from.prefix=net., leave keys out with init_from.exclude=['<regex>'], or load what fits "
            "with init_from.strict=false."
        )
    loadable = {k: v for k, v in weights.items() if k in expected and v.shape == expected[k].shape}
    module.load_state_dict(loadable, strict=False)
    skipped = [p for p in problems if not p.startswith(f"{len(missing)} missing")] if strict else problems
    line = f"init_from: loaded {len(loadable)} of the model's {len(expected)} tensors from {path}"
    if dropped:
        line += f"; left out by init_from.exclude: {len(dropped)}"
    if skipped:
        line += f"; not loaded: {'; '.join(skipped)}"
    return line
