"""0.3's home of `debug=trace`'s callback, now `hpctrain.callbacks.trace_steps`: the old `_target_` path
warns and still works."""

from hpctrain.runtime.moved import moved_names

__getattr__ = moved_names(__name__, {"TraceSteps": "hpctrain.callbacks.trace_steps.TraceSteps"})
