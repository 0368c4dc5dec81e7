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
  `FrozenParts`).

A requeued attempt of the same job continues from its own checkpoint; init_from is skipped there (said
once), never applied on top. Given together with `ckpt_path` it is refused: one or the other.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torchmetrics import Metric

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run.checkpoints.reading import read

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
        from hpctrain.runtime.run.checkpoints import sharded

        sharded.check_folder(path, "init_from.path")
    elif path.suffix != ".safetensors":  # safetensors holds tensors only: nothing to check before reading
        read_weights(path)


def _listed(keys: Sequence[str], what: str, show: int = 3) -> str:
    return f"{len(keys)} {what} ({', '.join(keys[:show])}{', ...' if len(keys) > show else ''})"


def apply(
    module: nn.Module,
    path: str | Path,
    strict: bool = True,
    exclude: Sequence[str] = (),
    prefix: str = "",
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


class FrozenParts(Callback):
    """Parameters matching `patterns` are not trained; BatchNorm layers whose parameters are all frozen
    are in eval mode while frozen, so their running statistics stay as loaded.

    Without `unfreeze_at_epoch` they get no gradient at all (requires_grad=False: the backward pass skips
    them). With it they are frozen by dropping their gradients before each optimizer step until that
    epoch, then trained like the rest. `requires_grad` never changes while training: DDP builds its
    gradient buckets once, when it wraps the model, and a parameter switched on later would not be
    synchronised across ranks (Lightning #20340); a dropped gradient is skipped by every torch optimizer
    (no update, no weight decay, no momentum), on every rank alike.
    """

    def __init__(
        self, module: nn.Module, patterns: Sequence[str], unfreeze_at_epoch: int | None = None
    ) -> None:
        self.patterns = list(patterns)
        self.unfreeze_at_epoch = unfreeze_at_epoch
        named = dict(module.named_parameters())
        frozen = [name for name in named if any(re.search(r, name) for r in self.patterns)]
        if not frozen:
            raise UserError(
                f"init_from.freeze={self.patterns} matches no parameter of the model; the names look like "
                f"{', '.join(list(named)[:3])}."
            )
        self.frozen = frozen
        self._parameters = [named[name] for name in frozen]
        if unfreeze_at_epoch is None:
            for parameter in self._parameters:
                parameter.requires_grad_(False)
        chosen = set(frozen)
        self.norms = [
            name
            for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and any(True for _ in m.parameters(recurse=False))
            and all(f"{name}.{p}" in chosen for p, _ in m.named_parameters(recurse=False))
        ]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The parameters by their names again: a sharded strategy (FSDP2) replaced them when it sharded the
        # model (configure_model), and a gradient dropped on a parameter the model no longer has frees nothing.
        named = dict(pl_module.named_parameters())
        self._parameters = [named[name] for name in self.frozen]

    def _frozen_now(self, trainer: Trainer) -> bool:
        return self.unfreeze_at_epoch is None or trainer.current_epoch < self.unfreeze_at_epoch

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning keeps each module's mode across validation, so a BatchNorm layer put in eval mode
        # stays there until it is put back in train mode here, on unfreezing.
        frozen = self._frozen_now(trainer)
        modules = dict(pl_module.named_modules())
        for name in self.norms:
            modules[name].train(not frozen)
        if not frozen and trainer.current_epoch == self.unfreeze_at_epoch and trainer.is_global_zero:
            log.info(
                "init_from: %d frozen parameters are trained from epoch %d on",
                len(self.frozen),
                trainer.current_epoch,
            )

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.unfreeze_at_epoch is not None and self._frozen_now(trainer):
            for parameter in self._parameters:
                parameter.grad = None
