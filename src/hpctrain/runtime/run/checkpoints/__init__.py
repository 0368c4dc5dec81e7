"""0.3's home of checkpointing, now `hpctrain.runtime.storage.checkpoints`: its names and modules warn
and still work."""

from hpctrain.runtime.moved import moved_module

__getattr__ = moved_module(__name__, "hpctrain.runtime.storage.checkpoints", {"extras": "resume_state"})
