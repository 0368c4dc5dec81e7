"""Checkpoint contents, in one place: how they are written, what the template adds to them, how they are read.

- Writing: `AtomicCheckpointIO` writes every checkpoint (last, best-k, requeue) to a temporary file
  in the same directory and renames it, so a process killed during a save leaves the previous file
  whole. (Lightning's own writer stages the file in /tmp and moves it, which on a different
  filesystem is a copy that a kill can cut short.) It keeps only the plain values of what
  `save_hyperparameters()` recorded (`plain_hyperparameters`): a network or a partial optimizer kept
  there would make the file unreadable with `weights_only=True`, and the template rebuilds every model
  from its config, never from those.
- Adding: `CheckpointExtras` stores every rank's RNG states and, mid-epoch, its running metric states
  (Lightning restores weights, optimizer, schedulers, loop counters and stateful dataloaders, but no
  random number generator and only rank 0's view of a metric), plus the resolved config that
  `src/eval.py` rebuilds the model from. All of it is plain tensors, numbers and strings.
- Reading: `read` loads with `weights_only=True` and turns every way a file can be wrong (missing,
  truncated, random bytes, pickled code, another model's weights) into one sentence.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import random
import re
from collections import OrderedDict
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.types import _Stateful
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer
from torch import Tensor
from torchmetrics import Metric

from hpctrain.runtime import cluster
from hpctrain.runtime.errors import UserError

log = logging.getLogger(__package__)

CONFIG_KEY = f"{__package__}_config"  # the resolved model and data config stored in every checkpoint


class UnreadableCheckpoint(UserError):
    pass


# ---------------------------------------------------------------------------------------------- writing


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into `.<name>.tmp-<pid>` beside the target, fsync, then an atomic rename."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        checkpoint = self._plain(checkpoint)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    _checked = False  # the first checkpoint of the process is checked for objects, then said once

    def _plain(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        checkpoint, left_out = plain_hyperparameters(checkpoint)
        if self._checked:
            return checkpoint
        self._checked = True
        check_readable(checkpoint)
        if left_out:
            log.info(
                "checkpoints keep the plain values of save_hyperparameters() only; left out: %s (objects "
                "cannot be read back with weights_only=True; this template rebuilds the model from its "
                "config, and Lightning's load_from_checkpoint needs them passed in, e.g. net=...)",
                ", ".join(left_out),
            )
        return checkpoint


def check_readable(checkpoint: dict[str, Any]) -> None:
    """Refuse, before it is written, a checkpoint that `weights_only=True` loading could not read back (an
    object put there by a hook or a callback's state_dict): its structure, with every tensor replaced
    by an empty one, goes through torch.save and torch.load as the file would."""
    buffer = io.BytesIO()
    torch.save(_skeleton(checkpoint), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        name = found.group(1) if found else "an object"
        where = _key_of(checkpoint, name.rsplit(".", 1)[-1]) or "an entry"
        raise UnreadableCheckpoint(
            f"the checkpoint's {where} holds a {name}, which weights_only=True loading refuses (resume, eval "
            "and predict would fail on it); keep tensors, numbers, strings, lists and dicts in on_save_checkpoint "
            "and state_dict (save an object's state, not the object)."
        ) from err


def _skeleton(value: Any) -> Any:
    if isinstance(value, Tensor):
        return torch.empty(0, dtype=value.dtype)
    if type(value) in (dict, OrderedDict):  # a dict subclass stays itself: loading must accept its class
        return {k: _skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _key_of(node: Any, class_name: str, path: str = "") -> str | None:
    """The dotted key of the first value in `node` whose class is named `class_name`."""
    if type(node).__name__ == class_name:
        return path or None
    items = node.items() if isinstance(node, dict) else enumerate(node) if type(node) in (list, tuple) else ()
    for key, value in items:
        found = _key_of(value, class_name, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


# where Lightning puts what save_hyperparameters() recorded, of the module and of the datamodule,
# and the class of an OmegaConf container recorded there
_HPARAMS = (LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, LightningDataModule.CHECKPOINT_HYPER_PARAMS_KEY)
_HPARAMS_TYPES = (
    LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE,
    LightningDataModule.CHECKPOINT_HYPER_PARAMS_TYPE,
)
_PLAIN = (str, int, float, bool, complex, bytes, type(None), Tensor, torch.Size, torch.dtype, torch.device)


def plain_hyperparameters(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`checkpoint` with its recorded hyperparameters reduced to plain values (numbers, strings, tensors,
    lists and dicts of them; OmegaConf containers as plain ones; paths as strings), and the dotted names
    of what was left out, with its type (e.g. `net (SimpleDenseNet)`). The checkpoint is not changed."""
    if not any(key in checkpoint for key in _HPARAMS):
        return checkpoint, []
    left_out: list[str] = []
    plain = {k: v for k, v in checkpoint.items() if k not in _HPARAMS_TYPES}
    for key in _HPARAMS:
        if key in plain:
            plain[key] = _plain_value(plain[key], "", left_out)
    return plain, left_out


_LEFT_OUT = object()


def _plain_value(value: Any, name: str, left_out: list[str]) -> Any:
    """`value` as plain data, or _LEFT_OUT (its name and type appended to `left_out`)."""
    if isinstance(value, DictConfig | ListConfig):
        try:
            value = OmegaConf.to_container(value, resolve=True)
        except Exception:  # an interpolation that cannot be resolved here: keep it as written
            value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        kept = {k: _plain_value(v, f"{name}{k}.", left_out) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _LEFT_OUT}
    if type(value) in (list, tuple):
        items = [_plain_value(v, name, []) for v in value]
        if all(item is not _LEFT_OUT for item in items):
            return type(value)(items)
    kind = type(value).__name__
    if isinstance(value, functools.partial):  # a `_partial_: true` optimizer or scheduler
        kind = f"partial {getattr(value.func, '__name__', type(value.func).__name__)}"
    left_out.append(f"{name[:-1] or 'hyperparameters'} ({kind})")
    return _LEFT_OUT


# ---------------------------------------------------------------------------------------------- reading


def read(path: str | Path, what: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint's contents (tensors memory-mapped, so reading only the config is cheap)."""
    path = Path(path)
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")
        raise UnreadableCheckpoint(
            f"{what}={path} holds pickled Python objects ({detail or 'not plain tensors'}), which are not "
            "loaded because loading them can run arbitrary code (weights_only=True); save the checkpoint "
            "with plain tensors and containers only (do not put modules or objects in save_hyperparameters)."
        ) from err
    except Exception as err:
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise UnreadableCheckpoint(
            f"{what}={path} is not a readable checkpoint ({reason}); it may be truncated or not a "
            "checkpoint at all: pass a complete .ckpt file (see <run dir>/checkpoints/)."
        ) from err
    if not isinstance(content, dict) or "state_dict" not in content:
        raise UnreadableCheckpoint(f"{what}={path} is not a Lightning checkpoint (it has no state_dict).")
    return content


def stored_config(path: str | Path) -> dict[str, Any]:
    """The model and data config a checkpoint of this template was trained with ({} for others)."""
    return read(path).get(CONFIG_KEY) or {}


def check_matches_model(
    path: str | Path, module: torch.nn.Module, what: str = "ckpt_path", content: dict[str, Any] | None = None
) -> None:
    """Refuse a checkpoint whose weights do not fit `module` (another model, or other sizes); `content`:
    the checkpoint already read, if the caller has it."""
    stored: dict[str, Tensor] = (content or read(path, what))["state_dict"]
    expected = module.state_dict()
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    resized = sorted(
        k for k in set(expected) & set(stored) if tuple(expected[k].shape) != tuple(stored[k].shape)
    )
    if not (missing or unexpected or resized):
        return
    details = []
    if missing:
        details.append(f"{len(missing)} weight(s) missing, e.g. {missing[0]}")
    if unexpected:
        details.append(f"{len(unexpected)} unknown, e.g. {unexpected[0]}")
    if resized:
        key = resized[0]
        details.append(
            f"{len(resized)} of another size, e.g. {key} {list(stored[key].shape)} vs {list(expected[key].shape)}"
        )
    raise UnreadableCheckpoint(
        f"{what}={path} holds the weights of a different model than the one configured ({'; '.join(details)}); "
        "pass a checkpoint of this model, or the model=/data= options it was trained with."
    )


_OPTIMIZER_NODES = ("optimizer", "scheduler", "lr_scheduler")
_OPTIMIZER_LEAVES = ("lr", "learning_rate", "weight_decay", "momentum", "betas", "eps")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(_flat(value, f"{prefix}{key}."))
    return flat


def _optimizer_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """The entries of a flattened model config that the optimizer and schedule are built from."""
    return {
        key: value
        for key, value in flat.items()
        if any(part in _OPTIMIZER_NODES for part in key.split(".")[:-1])
        or key.rsplit(".", 1)[-1] in _OPTIMIZER_LEAVES
    }


def resume_overrides(
    path: str | Path, model_cfg: dict[str, Any], content: dict[str, Any] | None = None
) -> str | None:
    """What resuming from `path` does to the configured optimizer and schedule, in one line (None if
    nothing): Lightning restores the optimizer and schedulers from the checkpoint, so a value changed on
    the command line (model.optimizer.lr=...) would otherwise be ignored without a word. An optimizer of
    another class cannot take the saved state at all: that is refused, in one sentence."""
    stored = ((content or read(path)).get(CONFIG_KEY) or {}).get("model")
    if not isinstance(stored, dict):
        return None  # not a checkpoint of this template: nothing to compare with
    then, now = _optimizer_keys(_flat(stored)), _optimizer_keys(_flat(model_cfg))
    for key in sorted(k for k in now if k.endswith("_target_") and k in then and then[k] != now[k]):
        raise UserError(
            f"ckpt_path={path} was trained with model.{key}={then[key]}, but model.{key}={now[key]} is configured: "
            "resuming continues the checkpoint's optimizer state, which the other class cannot take; resume with "
            f"the optimizer it was saved with, or start a new run from its weights: init_from.path={path}."
        )
    changed = [k for k in sorted(now) if not k.endswith(("_target_", "_partial_")) and then.get(k) != now[k]]
    if not changed:
        return None
    shown = ", ".join(f"model.{k}={now[k]} (the checkpoint has {then.get(k)})" for k in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return (
        f"resuming restores the optimizer and schedule saved in {path}, so these configured values are not "
        f"used: {shown}{more}; to train from its weights with a fresh optimizer, use init_from.path={path} instead."
    )


# ---------------------------------------------------------------------------------------------- adding


def capture_rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
        "python": {"version": version, "state": list(python_state), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    return [v.detach().cpu().clone() for v in value]


def capture_metric_states(module: LightningModule) -> dict[str, dict[str, Any]]:
    """The running states of every torchmetrics metric in `module` (this rank's share of the epoch)."""
    return {
        name: {key: _to_cpu(value) for key, value in metric.metric_state.items()}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric)
    }


def restore_metric_states(module: LightningModule, states: dict[str, dict[str, Any]]) -> None:
    for name, metric in module.named_modules():
        if isinstance(metric, Metric) and name in states:
            for key, value in states[name].items():
                moved = (
                    value.to(metric.device)
                    if isinstance(value, Tensor)
                    else [v.to(metric.device) for v in value]
                )
                setattr(metric, key, moved)


class CheckpointExtras(Callback):
    """Adds each rank's RNG and (mid-epoch) metric states and the config to every checkpoint, and
    restores this rank's share when training starts, before the first resumed batch.

    Lightning builds the checkpoint on every rank (rank 0 writes it), so the per-rank states are
    gathered there with one collective. Metric states are restored only when the train dataloader
    resumes mid-epoch too (the template's loaders do; a plain DataLoader restarts the epoch, and its
    restored counts would include batches that are trained again).
    """

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = config
        self._trainer: Trainer | None = None
        self._pending: dict[str, Any] | None = None  # the checkpoint's states, until fit starts
        self._state: dict[str, Any] | None = None  # this rank's share, until training starts

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.config is not None:
            checkpoint[CONFIG_KEY] = self.config

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning has read the checkpoint's callback states (load_state_dict) but not yet restored its
        # loops, and creates the first train iterator (which draws a plain DataLoader's shuffle seed
        # from the global RNG) before any later hook: every rank's random state comes back here.
        self._state = self._own_share(trainer)
        if self._state is not None:
            restore_rng_state(self._state["rng"])
        # A per-step schedule reads `trainer.estimated_stepping_batches` in configure_optimizers, which
        # builds the train loader (and starts iterating it) before Lightning restores the checkpoint;
        # Lightning then keeps that loader and never gives it its saved position (Lightning #20550), so
        # a run resumed mid-epoch would re-read the epoch from its start. On resume, drop the early
        # loader here (after configure_optimizers, before the restore): fit builds it again and restores it.
        loop = trainer.fit_loop
        if trainer.ckpt_path is not None and loop._combined_loader is not None:
            if loop._data_fetcher is not None:
                loop._data_fetcher.teardown()  # ends worker processes the early iterator started
                loop._data_fetcher = None
            loop._combined_loader = None

    def _own_share(self, trainer: Trainer) -> dict[str, Any] | None:
        """This rank's saved states, once (None when not resuming, or resumed with another world size)."""
        if self._pending is None:
            return None
        per_rank, self._pending = self._pending.get("per_rank", []), None
        if len(per_rank) != trainer.world_size:
            return None  # resumed with another number of processes: nothing per rank to restore
        return per_rank[trainer.global_rank]

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        state: dict[str, Any] = {"rng": capture_rng_state()}
        if trainer is not None and _mid_epoch(trainer):
            state["metrics"] = capture_metric_states(trainer.lightning_module)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, state)
            return {"per_rank": gathered}
        return {"per_rank": [state]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning restored the checkpoint, before the first resumed batch is transferred (and
        # augmented: the transfer hooks run before on_train_batch_start).
        state, self._state = self._state, None
        if state is None or "metrics" not in state:
            return
        if resumes_mid_epoch(trainer.train_dataloader):
            restore_metric_states(pl_module, state["metrics"])
        elif trainer.is_global_zero:
            log.warning(
                "resumed mid-epoch with a train dataloader that cannot resume (%s has no state_dict): "
                "the rest of this epoch is drawn from its start again and its epoch metrics cover only "
                "the resumed steps; the template's loaders (hpctrain.data.loading.make_loader) resume exactly",
                type(trainer.train_dataloader).__name__,
            )


def resumes_mid_epoch(loader: Any) -> bool:
    """Whether Lightning restores this loader's position within an epoch (it has state_dict/load_state_dict)."""
    return isinstance(loader, _Stateful)


def _mid_epoch(trainer: Trainer) -> bool:
    """Whether some, but not all, training batches of the current epoch are done."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return trainer.training and 0 < done < trainer.num_training_batches


def config_from_checkpoint(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """`cfg` with `model` and `data` replaced by the checkpoint's, unless the command line chose them.

    `model=...` / `data=...` keep the eval config's choice; `model.<key>=...` / `data.<key>=...` are
    applied on top of the checkpoint's config, and so is `monitor` (the metric it was trained to
    watch). The data directory is this command's `paths.data_dir` (said in the log), and
    the training job's node-local staging directory (`data.stage_dir`) is not reused unless given again.
    """
    stored = stored_config(checkpoint)
    for group in ("model", "data", "monitor"):
        chosen = any(o.lstrip("+~").startswith((f"{group}=", f"{group}/")) for o in overrides)
        if group not in stored or chosen:
            continue
        dotted = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith(f"{group}.")]
        replacement = OmegaConf.merge(
            OmegaConf.create(stored[group]), OmegaConf.from_dotlist(dotted).get(group) or {}
        )
        if group == "data" and "data_dir" in replacement:
            # the checkpoint's data_dir is where the training job's machine kept its data
            if not any(o.startswith("data.data_dir=") for o in dotted):
                replacement.data_dir = cfg.paths.data_dir
            if cluster.is_rank_zero():
                log.info(
                    "data: read from %s (paths.data_dir of this command; the checkpoint was trained on %s); "
                    "pass paths.data_dir=<dir> to read another",
                    replacement.data_dir,
                    stored[group].get("data_dir"),
                )
        if (
            group == "data"
            and "stage_dir" in replacement
            and not any(o.startswith("data.stage_dir=") for o in dotted)
        ):
            replacement.stage_dir = None  # the training job's node-local scratch is gone (or another job's)
        with open_dict(cfg):
            cfg[group] = replacement
    return cfg
