"""FSDP2 (`fully_shard`), applied from this one place: models know nothing of it.

`trainer=fsdp` (GPUs, nccl) and `trainer=fsdp_cpu` (CPU, gloo) train through Lightning's
`ModelParallelStrategy`, which expects the LightningModule to shard itself in `configure_model`. A
module that has no `configure_model` is sharded here instead, from the config (`dist.fsdp`):

- `shard`: the module classes whose instances are sharded one by one (each gathers its parameters
  only while it runs), then every child of the LightningModule that holds parameters as a root (the
  network: `fully_shard` on the LightningModule itself would never gather, since `training_step` need
  not call `forward`). `auto`: the outermost classes the network repeats (a Transformer's blocks, a
  ResNet's BasicBlocks; for a plain CNN, its layers).
- `param_dtype` / `reduce_dtype`: FSDP's mixed precision (the compute and the gradient reduction dtype).
- `activation_checkpointing`: each sharded block recomputes its activations in the backward pass.
- `cpu_offload`: parameters, gradients and optimizer states live in host memory between uses.

A module with its own `configure_model` is left alone (with `dist.fsdp.shard` set explicitly, the two
would disagree: refused). Checkpoints are folders, one shard file per rank, committed atomically
(`hpctrain.runtime.run.checkpoints.folder_saves`); nothing gathers the whole model on one rank.

Why FSDP1 (Lightning's `FSDPStrategy`) is gone: PyTorch keeps it in maintenance in favour of
`fully_shard`, it ran on GPUs only, and its full-state checkpoints gathered every shard on rank 0.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from hpctrain.runtime.distributed.job_store import set_data_parallel
from hpctrain.runtime.distributed.launch import _HydraLaunched
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

log = logging.getLogger(__package__)

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
SHARD_FILE_SUFFIX = ".distcp"
SHARDS_FROM_CONFIG = "_hpctrain_shards_from_config"  # marks the configure_model hpctrain gives a module


class FSDPOptionsError(UserError):
    pass


def _dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "null", "none"):
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise FSDPOptionsError(
            f"dist.fsdp dtype {name!r} is not a torch dtype; pass bfloat16, float16 or float32."
        )
    return dtype


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def roots(module: nn.Module) -> list[nn.Module]:
    """The children of the LightningModule that hold parameters: the networks, each an FSDP root."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise FSDPOptionsError(
            f"{type(module).__name__} holds parameters of its own ({', '.join(own[:3])}), outside any submodule: "
            "FSDP shards submodules; move them into a module (e.g. self.net) or use trainer=ddp."
        )
    return [child for child in module.children() if _has_parameters(child)]


def blocks(networks: Iterable[nn.Module], shard: Any) -> list[nn.Module]:
    """The instances sharded one by one: of the classes named in `shard`, or under `auto` the outermost
    classes the networks repeat (containers and parameterless modules aside): blocks made of layers
    where there are such (a Transformer's, a ResNet's), else the repeated layers (a plain CNN's)."""
    networks = list(networks)
    modules = [m for net in networks for m in net.modules() if m not in networks]
    if shard in (None, "auto"):
        counts: dict[type, int] = {}
        for m in modules:
            if not isinstance(m, CONTAINERS) and _has_parameters(m):
                counts[type(m)] = counts.get(type(m), 0) + 1
        repeated = {cls for cls, n in counts.items() if n >= 2}
        composite = {
            cls
            for cls in repeated
            if any(True for m in modules if type(m) is cls and next(m.children(), None))
        }
        chosen = composite or repeated  # blocks of layers where the network has them, else its layers
    else:
        names = [shard] if isinstance(shard, str) else list(shard)
        present = {type(m).__name__ for m in modules}
        missing = [n for n in names if n not in present]
        if missing:
            raise FSDPOptionsError(
                f"dist.fsdp.shard names {', '.join(missing)}, which the model does not contain; its classes "
                f"include {', '.join(sorted(present - {'Sequential', 'ModuleList', 'ModuleDict'})[:12])}."
            )
        chosen = {type(m) for m in modules if type(m).__name__ in names}
    found: list[nn.Module] = []
    for net in networks:
        _outermost(net, chosen, found)
    return found


def _outermost(module: nn.Module, chosen: set[type], found: list[nn.Module]) -> None:
    for child in module.children():
        if type(child) in chosen and _has_parameters(child):
            found.append(child)
        else:
            _outermost(child, chosen, found)


def _checkpointed(module: nn.Module) -> None:
    """Recompute the block's activations in the backward pass (torch.utils.checkpoint, non-reentrant)."""

    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed  # type: ignore[method-assign]


def apply_tensor_parallel(networks: list[nn.Module], mesh: Any, plan: dict[str, list[str]]) -> int:
    """Split the layers the plan names (patterns of module names inside each network, `*` for any one
    name) by output columns (`colwise`) or input rows (`rowwise`) over `mesh`; how many were split."""

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = sorted(set(plan) - set(styles))
    if unknown:
        raise FSDPOptionsError(
            f"dist.tensor_parallel_plan has {', '.join(unknown)}; its keys are colwise and rowwise (lists of "
            "module name patterns)."
        )
    split = 0
    for net in networks:
        names = [name for name, _ in net.named_modules() if name]
        chosen: dict[str, Any] = {}
        for style, patterns in plan.items():
            for pattern in patterns or []:
                chosen.update({n: styles[style]() for n in names if _matches(n, pattern)})
        if chosen:
            parallelize_module(net, mesh, chosen)
            split += len(chosen)
    if not split:
        raise FSDPOptionsError(
            f"dist.tensor_parallel_plan names no layer of the model ({plan}); check its patterns against the "
            "module names of the network (print(model))."
        )
    return split


def _matches(name: str, pattern: str) -> bool:
    """`blocks.*.q` matches `blocks.3.q`: the same number of parts, each equal or `*`."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in ("*", p) for p, w in zip(parts, wanted, strict=True))


def apply_fsdp(module: nn.Module, mesh: Any, options: dict[str, Any]) -> list[nn.Module]:
    """Shard `module`'s networks as the module docstring says; the blocks sharded one by one."""

    kwargs: dict[str, Any] = {"mesh": mesh}
    param_dtype, reduce_dtype = _dtype(options.get("param_dtype")), _dtype(options.get("reduce_dtype"))
    if param_dtype or reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if options.get("cpu_offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy()
    networks = roots(module)
    sharded = blocks(networks, options.get("shard", "auto"))
    for block in sharded:
        if options.get("activation_checkpointing"):
            _checkpointed(block)
        fully_shard(block, **kwargs)
    for net in networks:
        fully_shard(net, **kwargs)
    return sharded


MODEL_PARALLEL = "pytorch_lightning.strategies.ModelParallelStrategy"


class HydraModelParallelStrategy(_HydraLaunched, LightningPart, lightning=MODEL_PARALLEL):
    """Lightning's ModelParallelStrategy (FSDP2, DTensor) with the Hydra-aware launcher, the template's
    sharding for modules without `configure_model`, and checkpoints committed atomically."""

    def __init__(
        self,
        saves: Any,
        fsdp: dict[str, Any] | None = None,
        tensor_parallel_plan: dict[str, list[str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(save_distributed_checkpoint=True, **kwargs)
        self.saves = saves  # how checkpoints are committed: run.checkpoints.folder_saves.FolderSaves
        self.fsdp_options = dict(fsdp or {})
        self.tensor_parallel_plan = dict(tensor_parallel_plan or {})

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return self.namespace.get(MODEL_PARALLEL).distributed_sampler_kwargs.fget(
            self
        )  # not _HydraLaunched's

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        tensor = self._tensor_parallel_size
        tensor = 1 if tensor == "auto" else int(tensor)
        if self.world_size % tensor:
            raise FSDPOptionsError(
                f"dist.tensor_parallel={tensor} does not divide the {self.world_size} processes; pass a divisor of "
                f"{self.world_size}."
            )
        self._tensor_parallel_size = tensor
        if self._data_parallel_size == "auto":  # Lightning's default is the number of nodes
            self._data_parallel_size = self.world_size // tensor

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._timeout is not None:  # the mesh's groups get torch's default otherwise: 10 minutes on NCCL
            for group in self.device_mesh.get_all_groups():
                torch.distributed.set_timeout(self._timeout, group=group)
        data = self.device_mesh["data_parallel"]
        set_data_parallel(data.size(), data.get_local_rank())  # hpctrain's loaders shard over it
        module = self.lightning_module
        shard = self.fsdp_options.get("shard", "auto")
        if (
            self._tensor_parallel_size > 1
            and not self.tensor_parallel_plan
            and not self.namespace.is_overridden("configure_model", module)
        ):
            raise FSDPOptionsError(
                f"dist.tensor_parallel={self._tensor_parallel_size}: the model's config ships no tensor-parallel plan "
                "(dist.tensor_parallel_plan); train with dist.tensor_parallel=1, or shard it in configure_model."
            )
        if getattr(module.configure_model, SHARDS_FROM_CONFIG, False):
            return  # ours, installed at fit's setup: Lightning calls setup again for the test after fit
        if self.namespace.is_overridden("configure_model", module):
            if shard not in (None, "auto"):
                raise FSDPOptionsError(
                    f"{type(module).__name__} shards itself in configure_model, and dist.fsdp.shard={shard} would "
                    "shard it again; drop dist.fsdp.shard, or remove configure_model and let hpctrain shard."
                )
            return
        options, mesh = self.fsdp_options, self.device_mesh
        done: list[bool] = []

        def configure_model() -> None:  # what Lightning calls on every rank, for fit and again for test
            if done:
                return
            done.append(True)
            names = [type(r).__name__ for r in roots(module)]  # fully_shard renames the classes (FSDP<name>)
            tensor = mesh["tensor_parallel"].size()
            if tensor > 1:
                split = apply_tensor_parallel(
                    roots(module), mesh["tensor_parallel"], self.tensor_parallel_plan
                )
                if self.global_rank == 0:
                    log.info("tensor parallel: %d layer(s) split over %d process(es) each", split, tensor)
            sharded = apply_fsdp(module, mesh["data_parallel"], options)
            if self.global_rank == 0:
                log.info(
                    "FSDP2: %d block(s) sharded over %d process(es) (%s), then %s as root(s)",
                    len(sharded),
                    mesh["data_parallel"].size(),
                    ", ".join(sorted({type(b).__name__.removeprefix("FSDP") for b in sharded})) or "none",
                    ", ".join(names),
                )

        setattr(configure_model, SHARDS_FROM_CONFIG, True)  # told apart from a module's own
        module.configure_model = configure_model  # type: ignore[method-assign]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        return _agreed_buffers(state, self.lightning_module, self.root_device)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A folder committed whole (`saves`, hpctrain.runtime.run.checkpoints.folder_saves); the write
        into it is Lightning's: one shard per rank."""
        write = super().save_checkpoint
        self.saves.save(self, checkpoint, filepath, lambda folder: write(checkpoint, folder, storage_options))

    @property
    def last_save(self) -> Any:
        return self.saves.last_save  # the newest save's path, step and time (for the requeue signal's lead)

    def wait_for_saves(self) -> None:
        self.saves.wait()

    def teardown(self) -> None:
        self.saves.wait()  # the best checkpoint is tested next, and a process must not end mid-write
        super().teardown()

    def remove_checkpoint(self, filepath: Any) -> None:
        self.saves.remove(self.global_rank, filepath)


def _agreed_buffers(state: dict[str, Any], module: Any, device: Any) -> dict[str, Any]:
    """Buffers are not sharded: each rank keeps its own, and a distributed checkpoint stores one rank's.
    Those that differ between ranks (BatchNorm statistics without sync_batchnorm) are averaged over the
    ranks in what is saved; those that agree are saved as they are, bit for bit."""

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return state
    buffers = {name for name, _ in module.named_buffers()}
    for key, value in list(state.items()):
        if key not in buffers or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        on = value.to(device)  # nccl reduces on the GPU
        high, low = on.clone(), on.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        if not torch.equal(high, low):
            mean = on.clone()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            state[key] = (mean / dist.get_world_size()).to(value.device)
    return state
