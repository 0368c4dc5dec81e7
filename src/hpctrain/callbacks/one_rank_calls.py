"""A callback that runs the model on one rank under a sharded strategy, named in one sentence within seconds.

Under FSDP2 (and tensor parallelism) a forward gathers parameters from every rank. A callback that runs
the model on rank 0 alone (a text sample, a plot of predictions, `if trainer.is_global_zero: model(x)`)
leaves rank 0 waiting in that gather while the other ranks wait in their next collective: the job hangs
until `dist.timeout_min` (30 minutes by default), and then names a collective, not the callback.

`OneRankCalls`, added by the template's build under a sharded strategy, knows which callback hook is
running on each rank (it wraps the hooks the user's callbacks override, on the instances: nothing of
Lightning changes) and puts a forward pre-hook on the model's networks. The first forward inside a
callback hook meets the other ranks through the job's store (no collective): each rank that runs the
model there adds itself under the hook's name and call count, and waits up to `WAIT_S` for all of them.
If they do not all come, the rank raises one sentence naming the callback, its hook and the fix, and the
watchdog ends the others within a second.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from hpctrain.runtime.distributed.job_store import rank, store
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

if TYPE_CHECKING:
    from pytorch_lightning import Callback, LightningModule, Trainer

WAIT_S = 10.0
KEY = "hpctrain/one-rank-call"  # a key of the job store


class OneRankCall(UserError):
    pass


class OneRankCalls(LightningPart, lightning="pytorch_lightning.Callback"):
    """See the module docstring. `names`: the config name of each of the run's callbacks (by id)."""

    def __init__(self, names: dict[int, str] | None = None, wait_s: float = WAIT_S) -> None:
        self.names = dict(names or {})
        self.wait_s = wait_s
        self._current = threading.local()  # the callback hook this thread runs, if any
        self._calls: dict[tuple[str, str], int] = {}  # how often each hook was entered on this rank
        self._hooked: set[int] = set()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for callback in trainer.callbacks:
            if callback is not self and not type(callback).__module__.startswith("hpctrain."):
                self._wrap(callback)

    def _hook_networks(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After the model was sharded (configure_model runs after the setup hooks): first among the
        networks' pre-forward hooks, ahead of FSDP's, whose gather would wait before this one looks."""
        for network in pl_module.children():
            if id(network) not in self._hooked and any(True for _ in network.parameters()):
                network.register_forward_pre_hook(self._before_forward, prepend=True)
                self._hooked.add(id(network))

    on_sanity_check_start = on_fit_start = on_validation_start = _hook_networks
    on_test_start = on_predict_start = _hook_networks

    def _wrap(self, callback: Callback) -> None:
        name = self.names.get(id(callback), type(callback).__name__)
        base = self.namespace.get("pytorch_lightning.Callback")  # Lightning's, of this run's namespace
        for hook in [h for h in dir(base) if h.startswith("on_")]:
            own = getattr(type(callback), hook, None)
            if own is None or own is getattr(base, hook) or getattr(own, "_one_rank_watched", False):
                continue
            bound = getattr(callback, hook)
            if getattr(bound, "_one_rank_watched", False):
                continue
            setattr(callback, hook, self._watched(bound, name, hook))

    def _watched(self, bound: Any, name: str, hook: str) -> Any:
        @functools.wraps(bound)
        def watched(*args: Any, **kwargs: Any) -> Any:
            count = self._calls.get((name, hook), 0) + 1
            self._calls[(name, hook)] = count
            outer = getattr(self._current, "hook", None)
            self._current.hook = (name, hook, count, False)
            try:
                return bound(*args, **kwargs)
            finally:
                self._current.hook = outer

        watched._one_rank_watched = True  # type: ignore[attr-defined]
        return watched

    def _before_forward(self, module: Any, args: Any) -> None:
        current = getattr(self._current, "hook", None)
        if current is None or current[3]:
            return  # outside a callback hook, or already met the other ranks in this call of it
        name, hook, count, _ = current
        self._current.hook = (name, hook, count, True)
        job = store()
        if job is None:
            return

        world = dist.get_world_size()
        key = f"{KEY}/{name}/{hook}/{count}"
        arrived = job.add(key, 1)
        deadline = time.monotonic() + self.wait_s
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = job.add(key, 0)
        if arrived < world:
            raise OneRankCall(
                f"callbacks.{name} runs the model in {hook} on rank {rank()} "
                f"but not on every rank ({arrived} of {world} came within {self.wait_s:g} s): under a sharded "
                "strategy a forward gathers the parameters from every rank, so the others would wait for it until "
                f"dist.timeout_min; run the model on every rank in {hook} and keep only the logging to rank 0 "
                "(if trainer.is_global_zero: log...)."
            )
