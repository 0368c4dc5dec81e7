"""0.3's home of the run's callbacks, now one module each in `hpctrain.callbacks`: the old `_target_`
paths (`hpctrain.runtime.run.callbacks.ModelCheckpoint`, `...EarlyStopping`) warn and still work."""

from hpctrain.runtime.moved import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "ModelCheckpoint": "hpctrain.callbacks.model_checkpoint.ModelCheckpoint",
        "EarlyStopping": "hpctrain.callbacks.early_stopping.EarlyStopping",
        "MonitoredMetric": "hpctrain.callbacks.monitored_metric.MonitoredMetric",
        "SharedRunDirCheck": "hpctrain.callbacks.shared_run_dir_check.SharedRunDirCheck",
        "AttemptProgress": "hpctrain.callbacks.attempt_progress.AttemptProgress",
        "RankWatchdog": "hpctrain.callbacks.rank_watchdog.RankWatchdog",
    },
)
