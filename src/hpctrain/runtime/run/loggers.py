"""0.3's home of the loggers, now `hpctrain.loggers`: the old `_target_` paths warn and still work."""

from hpctrain.runtime.moved import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: f"hpctrain.loggers.{name}"
        for name in ("ResumableCSVLogger", "mlflow_logger", "wandb_logger", "job_metadata", "tag_runs")
    },
)
