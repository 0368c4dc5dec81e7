"""0.3's home of `hpctrain.runtime.storage.attempts`: its names warn and still work."""

from hpctrain.runtime.moved import moved_module

__getattr__ = moved_module(__name__, "hpctrain.runtime.storage.attempts")
