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
  Norm layers with running statistics (BatchNorm, InstanceNorm) stay in float32 under it: each is a unit
  of its own whose policy computes in float32 and hands the compute dtype on (FSDP's policy would cast
  their weights but not their float32 statistics, and the kernel refuses the mix).
- `activation_checkpointing`: each sharded block recomputes its activations in the backward pass.
- `cpu_offload`: parameters, gradients and optimizer states live in host memory between uses.
- `sync_each_micro_batch`: under `trainer.accumulate_grad_batches=N`, false (the default) reduces the
  gradients once per optimizer step (`set_requires_gradient_sync`), each rank holding its unsharded
  gradients between micro-batches; true reduce-scatters every micro-batch (N times the traffic, the
  memory of a step without accumulation).

With `compile=true` each sharded block's forward is compiled on its own, after tensor parallelism and
before `fully_shard` (torchtitan's order; under activation checkpointing, inside the checkpoint): FSDP's
hooks stay outside the compiled graphs, and the repeated blocks share one compilation. Gradient clipping
(`trainer.gradient_clip_val`) takes the norm of each mesh's gradients, then combines them: under
tensor parallelism the split layers' gradients live on the 2-D mesh and the rest on the data-parallel
one, and one norm over both is refused by DTensor.

A module with its own `configure_model` is left alone (with `dist.fsdp.shard` set explicitly, the two
would disagree: refused). Checkpoints are folders, one shard file per rank, committed atomically
(`hpctrain.runtime.storage.checkpoints.folder_saves`); nothing gathers the whole model on one rank.

Why FSDP1 (Lightning's `FSDPStrategy`) is gone: PyTorch keeps it in maintenance in favour of
`fully_shard`, it ran on GPUs only, and its full-state checkpoints gathered every shard on rank 0.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import types
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from hpctrain.runtime.distributed.job_store import set_data_parallel
from hpctrain.runtime.distributed.launch import _HydraLaunched
from hpctrain.runtime.distributed.materialize import has_empty_parameters, materialize
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

log = logging.getLogger(__package__)

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
SHARDS_FROM_CONFIG = "_hpctrain_shards_from_config"  # marks the configure_model hpctrain gives a module
# Norm layers that keep running statistics in float32 buffers: under FSDP's mixed precision each is a unit
# of its own, computed in float32 (torchtitan#674: cast to bfloat16 beside float32 statistics, they fail)
NORMS_WITH_STATISTICS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


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


def _compiled_and_checkpointed(module: nn.Module, compile_backend: str | None, recompute: bool) -> None:
    """The block's forward compiled (`compile_backend`) and/or its activations recomputed in the backward
    pass (torch.utils.checkpoint, non-reentrant), the compiled forward inside the checkpoint: traced the
    other way round, under tensor parallelism, torch's compiled checkpoint saves DTensor's device mesh for
    the backward pass and fails. The module's own `forward` is replaced (its state-dict keys stay), so
    FSDP's hooks run outside the compiled graph."""
    forward = module.forward
    if compile_backend:
        forward = torch.compile(forward, backend=compile_backend)
    if recompute:
        inner = forward

        @functools.wraps(module.forward)
        def recomputed(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

        forward = recomputed
    if forward is not module.forward:
        module.forward = forward  # type: ignore[method-assign]


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


def norm_layers(networks: Iterable[nn.Module]) -> list[nn.Module]:
    """The norm layers with running statistics and parameters of their own (`NORMS_WITH_STATISTICS`)."""
    networks = list(networks)
    return [
        m
        for net in networks
        for m in net.modules()
        if isinstance(m, NORMS_WITH_STATISTICS) and m not in networks and _has_parameters(m)
    ]


def _float32_policy(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """A norm layer's: its inputs, weights and statistics in float32, its output in the network's compute
    dtype (what the next layer of a lower-precision unit expects, with or without autocast)."""
    return MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=policy.param_dtype
    )


def apply_fsdp(
    module: nn.Module, mesh: Any, options: dict[str, Any], compile_backend: str | None = None
) -> tuple[list[nn.Module], list[nn.Module]]:
    """Shard `module`'s networks as the module docstring says; the blocks sharded one by one and the norm
    layers kept in float32. With `compile_backend`, each block's forward is compiled (its state-dict keys
    stay) before it is sharded."""
    kwargs: dict[str, Any] = {"mesh": mesh}
    param_dtype, reduce_dtype = _dtype(options.get("param_dtype")), _dtype(options.get("reduce_dtype"))
    policy = None
    if param_dtype or reduce_dtype:
        policy = kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    if options.get("cpu_offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy()
    networks = roots(module)
    lower = policy is not None and policy.param_dtype not in (None, torch.float32)
    norms = norm_layers(networks) if lower else []
    for norm in norms:  # innermost first: fully_shard takes a module's children before the module
        fully_shard(norm, **{**kwargs, "mp_policy": _float32_policy(policy)})  # type: ignore[arg-type]
    candidates = apart_from_tied(blocks(networks, options.get("shard", "auto")), networks)
    sharded = [b for b in candidates if b not in norms]
    for block in sharded:
        _compiled_and_checkpointed(block, compile_backend, bool(options.get("activation_checkpointing")))
        _shard_by_dtype(block, kwargs)
    for net in networks:
        _shard_by_dtype(net, kwargs)
        if callable(getattr(net, "generate", None)):
            # generate (a Hugging Face model's, a PEFT model's) calls the inner model, not forward: without
            # this the root's parameters are never gathered for it ("mixed torch.Tensor and DTensor")
            register_fsdp_forward_method(net, "generate")
    return sharded, norms


def clip_grad_norm_over_meshes(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for gradients on several device meshes (tensor parallelism: the
    split layers' on the data x tensor mesh, the rest on the data-parallel one), which DTensor refuses to
    combine: each rank sums its local shards' norms, each divided by the number of ranks that hold the
    same shard (the replicas along a mesh dimension, and the meshes beside this one), and one all-reduce
    over the ranks makes the total; then each mesh's gradients are scaled by the one coefficient. The
    total norm is returned, as torch's clip_grad_norm_ does."""
    with_grads = [p for p in parameters if p.grad is not None]
    if not with_grads:
        return torch.tensor(0.0)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    by_copies: dict[int, list[torch.Tensor]] = {}  # local gradients by how many ranks hold each
    by_mesh: dict[Any, list[torch.Tensor]] = {}  # parameters by their gradients' mesh (None: plain)
    for param in with_grads:
        grad, copies = param.grad, world
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            replicated = [
                mesh.size(i) for i, placement in enumerate(grad.placements) if placement.is_replicate()
            ]
            copies = world // mesh.size() * math.prod(replicated)
            grad = grad.to_local()
        by_copies.setdefault(copies, []).append(grad)
        by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    device = next(iter(by_copies.values()))[0].device
    infinite = math.isinf(norm_type)
    parts = [
        torch.nn.utils.get_total_norm(grads, norm_type).to(device, torch.float32)
        for grads in by_copies.values()
    ]
    if infinite:
        total = torch.stack(parts).max()
    else:
        total = sum(part.pow(norm_type) / copies for part, copies in zip(parts, by_copies, strict=True))
    if world > 1:
        # under cpu_offload the norm is on the host, and NCCL reduces GPU tensors only
        on = total.cuda() if total.device.type == "cpu" and dist.get_backend() == "nccl" else total
        dist.all_reduce(on, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
        total = on.to(device)
    if not infinite:
        total = total.pow(1.0 / norm_type)
    for params in by_mesh.values():  # torch scales the gradients of one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float) -> None:
    """Lightning's `Precision.clip_grad_by_norm`, over meshes (installed on this strategy's plugin)."""
    clip_grad_norm_over_meshes(plugin.main_params(optimizer), clip_val)


def apart_from_tied(candidates: list[nn.Module], networks: list[nn.Module]) -> list[nn.Module]:
    """The blocks that may be sharded one by one: a block holding a parameter that is also used outside it
    (tied input and output embeddings, a weight shared across blocks) stays in the unit around it, where
    one gathering serves every use; a separate unit would hand the other users its unsharded shard."""
    owners: dict[int, set[int]] = {}
    for net in networks:
        for owner in net.modules():
            for param in owner.parameters(recurse=False):
                owners.setdefault(id(param), set()).add(id(owner))
    kept = []
    for block in candidates:
        inside = {id(m) for m in block.modules()}
        if all(owners[id(p)] <= inside for p in block.parameters()):
            kept.append(block)
        else:
            log.info(
                "FSDP2: %s shares a parameter with modules outside it: sharded with its parent",
                type(block).__name__,
            )
    return kept


def _shard_by_dtype(unit: nn.Module, kwargs: dict[str, Any]) -> None:
    """fully_shard(unit); where its trainable parameters have several dtypes (fp32 adapters on a bf16
    base, one trainable norm kept in fp32), the modules holding the less common dtypes become units of
    their own first: FSDP2 gathers and reduces one dtype per unit (else an AssertionError at the first step)."""
    trainable = _unit_trainable(unit)
    dtypes = {p.dtype for _, p in trainable}
    if len(dtypes) > 1:
        common = max(dtypes, key=lambda d: sum(p.numel() for _, p in trainable if p.dtype == d))
        for name, holder in _holders(unit):
            own = {p.dtype for p in holder.parameters(recurse=False) if p.requires_grad}
            if len(own) > 1:
                raise FSDPOptionsError(
                    f"{name or type(unit).__name__} holds trainable parameters of several dtypes "
                    f"({', '.join(sorted(str(d) for d in own))}), which FSDP2 cannot shard as one unit; cast them "
                    "to one dtype in the model, or set dist.fsdp.param_dtype and keep the parameters in float32."
                )
            if own and common not in own and holder is not unit:
                fully_shard(holder, **kwargs)
        left = {str(p.dtype) for _, p in _unit_trainable(unit)}
        if len(left) > 1:
            raise FSDPOptionsError(
                f"{type(unit).__name__} holds trainable parameters of several dtypes ({', '.join(sorted(left))}) "
                "directly, which FSDP2 cannot shard as one unit; cast them to one dtype in the model."
            )
    fully_shard(unit, **kwargs)


def _unit_trainable(unit: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters a fully_shard(unit) would manage (those of sub-units already sharded aside)."""
    return [(n, p) for n, h in _holders(unit) for p in h.parameters(recurse=False) if p.requires_grad]


def _holders(unit: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules under `unit` (itself included) whose own parameters it would manage."""
    stack = [("", unit)]
    while stack:
        name, module = stack.pop()
        yield name, module
        stack += [
            (f"{name}.{child_name}" if name else child_name, child)
            for child_name, child in module.named_children()
            if not isinstance(child, FSDPModule)
        ]


MODEL_PARALLEL = "pytorch_lightning.strategies.ModelParallelStrategy"


class HydraModelParallelStrategy(_HydraLaunched, LightningPart, lightning=MODEL_PARALLEL):
    """Lightning's ModelParallelStrategy (FSDP2, DTensor) with the Hydra-aware launcher, the template's
    sharding for modules without `configure_model`, and checkpoints committed atomically."""

    def __init__(
        self,
        saves: Any,
        fsdp: dict[str, Any] | None = None,
        tensor_parallel_plan: dict[str, list[str]] | None = None,
        compile_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(save_distributed_checkpoint=True, **kwargs)
        self.saves = saves  # how checkpoints are committed: storage.checkpoints.folder_saves.FolderSaves
        self.fsdp_options = dict(fsdp or {})
        self.tensor_parallel_plan = dict(tensor_parallel_plan or {})
        self.compile_backend = compile_backend  # compile=true: each block compiled before it is sharded

    @property
    def precision_plugin(self) -> Any:
        return self.namespace.get(MODEL_PARALLEL).precision_plugin.fget(self)  # Lightning's getter

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning's clipping takes one norm over every gradient, which DTensor refuses for gradients on
        # two meshes (tensor parallelism); this strategy's own plugin clips over meshes instead
        if plugin is not None:
            plugin.clip_grad_by_norm = types.MethodType(_clip_grad_by_norm, plugin)
        self._precision_plugin = plugin

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's hook for the micro-batches of `accumulate_grad_batches` that do not end a step:
        no gradient reduction until the last one (`dist.fsdp.sync_each_micro_batch=true`: every one)."""
        units = [m for m in self.lightning_module.modules() if isinstance(m, FSDPModule)]
        if self.fsdp_options.get("sync_each_micro_batch") or not units:
            yield None
            return
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Lightning's ModelParallelStrategy's (of this strategy's namespace), not _HydraLaunched's
        return self.namespace.get(MODEL_PARALLEL).distributed_sampler_kwargs.fget(self)

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
            sharded, norms = apply_fsdp(module, mesh["data_parallel"], options, self.compile_backend)
            if has_empty_parameters(module):  # a pretrained base built empty: each rank reads its shards
                read = materialize(module, self.root_device)
                if self.global_rank == 0:
                    log.info("pretrained base: %d tensors read into their shards", read)
            if self.global_rank == 0:
                log.info(
                    "FSDP2: %d block(s) sharded over %d process(es) (%s), then %s as root(s)%s%s",
                    len(sharded),
                    mesh["data_parallel"].size(),
                    ", ".join(sorted({type(b).__name__.removeprefix("FSDP") for b in sharded})) or "none",
                    ", ".join(names),
                    f"; {len(norms)} norm layer(s) kept in float32" if norms else "",
                    f"; each block compiled ({self.compile_backend})" if self.compile_backend else "",
                )

        setattr(configure_model, SHARDS_FROM_CONFIG, True)  # told apart from a module's own
        module.configure_model = configure_model  # type: ignore[method-assign]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.saves.asynchronous:
            state = super().lightning_module_state_dict()
        else:  # left where it is: the save's staging copies it, into host buffers it keeps (folder_saves)
            state = get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))
        return _agreed_buffers(state, self.lightning_module, self.root_device)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self.saves.asynchronous:
            return super().optimizer_state(optimizer)
        # Lightning's offloads every state to fresh host memory first, a second copy per save
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        return get_optimizer_state_dict(self.model, inner, options=StateDictOptions(cpu_offload=False))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A folder committed whole (`saves`, hpctrain.runtime.storage.checkpoints.folder_saves); the write
        into it is Lightning's: one shard per rank."""
        write = super().save_checkpoint
        self.saves.save(
            self, checkpoint, filepath, lambda state, folder: write(state, folder, storage_options)
        )

    @property
    def last_save(self) -> Any:
        return self.saves.last_save  # the newest save's path, step and time (for the requeue signal's lead)

    def wait_for_saves(self) -> None:
        self.saves.wait()

    def teardown(self) -> None:
        self.saves.close()  # the best checkpoint is tested next, and a process must not end mid-write
        super().teardown()

    def remove_checkpoint(self, filepath: Any) -> None:
        self.saves.remove(self.global_rank, filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder is read once, by hpctrain (`saves.load`: its index parsed and checked, then
        handed to torch, which never reads it again); a file as Lightning reads it."""
        path = self.broadcast(checkpoint_path)
        if not self.saves.is_folder(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)}
        assert self.lightning_module is not None
        return self.saves.load(path, self.model, optimizers, strict=self.lightning_module.strict_loading)


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
