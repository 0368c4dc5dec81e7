"""0.3's home of the streams' mark, now in `hpctrain.data.iterable` beside the streams: warned, still works."""

from hpctrain.runtime.moved import moved_names

__getattr__ = moved_names(
    __name__, {name: f"hpctrain.data.iterable.{name}" for name in ("MARK", "shares_itself_out")}
)
