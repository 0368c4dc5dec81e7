"""Lightning's callback dispatch, without the calls that do nothing (pytorch-lightning 2.6).

Lightning calls every hook of every callback at every step (about eight hooks a step), each wrapped
in a profiler region whose name it formats on the spot, even when the callback does not implement
the hook and the call is the base class's empty method. With the template's dozen callbacks that is
close to a hundred empty calls, about 0.1 ms, per training step: as much as the rest of the template
costs. `fast_callback_hooks(trainer)` makes that trainer skip callbacks whose hook is the base
class's no-op; the hooks a callback does implement run exactly as before, in the same order, with the
same `_current_fx_name` bookkeeping and, when a profiler is configured, the same profiler regions.

Lightning's loops call `pytorch_lightning.trainer.call._call_callback_hooks` through the module, so
replacing that function once (on import) reaches them; trainers not marked by `fast_callback_hooks`
go through Lightning's original function unchanged. tests/test_dispatch.py fails when a Lightning
release changes the function this replaces.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning import Callback
from pytorch_lightning.callbacks import Checkpoint, EarlyStopping
from pytorch_lightning.profilers import PassThroughProfiler
from pytorch_lightning.trainer import call as lightning_call

_lightning_call_callback_hooks = getattr(lightning_call, "_lightning_call_callback_hooks", None) or (
    lightning_call._call_callback_hooks
)
_MARK = "_fast_callback_hooks"


def _implements(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook, None) is not getattr(Callback, hook, None)


def _callbacks_for(trainer: Any, hook: str, monitoring: bool | None) -> list[Callback]:
    callbacks = trainer.callbacks
    cache = trainer.__dict__.get(_MARK)
    if cache is None or cache[0] is not callbacks or cache[1] != len(callbacks):
        cache = (callbacks, len(callbacks), {})
        trainer.__dict__[_MARK] = cache
    chosen = cache[2].get((hook, monitoring))
    if chosen is None:
        chosen = [c for c in callbacks if _implements(c, hook)]
        if monitoring is True:
            chosen = [c for c in chosen if isinstance(c, (EarlyStopping, Checkpoint))]
        elif monitoring is False:
            chosen = [c for c in chosen if not isinstance(c, (EarlyStopping, Checkpoint))]
        cache[2][(hook, monitoring)] = chosen
    return chosen


def _call_callback_hooks(
    trainer: Any, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
) -> None:
    if _MARK not in trainer.__dict__:
        return _lightning_call_callback_hooks(
            trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs
        )
    callbacks = _callbacks_for(trainer, hook_name, monitoring_callbacks)
    if not callbacks:
        return None
    pl_module = trainer.lightning_module
    if pl_module:
        prev_fx_name = pl_module._current_fx_name
        pl_module._current_fx_name = hook_name
    profiler = trainer.profiler
    for callback in callbacks:
        fn = getattr(callback, hook_name)
        if isinstance(profiler, PassThroughProfiler):
            fn(trainer, trainer.lightning_module, *args, **kwargs)
        else:
            with profiler.profile(f"[Callback]{callback.state_key}.{hook_name}"):
                fn(trainer, trainer.lightning_module, *args, **kwargs)
    if pl_module:
        pl_module._current_fx_name = prev_fx_name
    return None


def fast_callback_hooks(trainer: Any) -> None:
    """Dispatch this trainer's callback hooks without the calls to base-class no-ops."""
    trainer.__dict__[_MARK] = None


lightning_call._lightning_call_callback_hooks = _lightning_call_callback_hooks
lightning_call._call_callback_hooks = _call_callback_hooks
