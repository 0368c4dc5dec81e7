"""The template's Lightning callbacks, one a module, under the paths the YAML's `_target_`s name.

Chosen in the `callbacks` group (conf/callbacks/, hpctrain's conf/callbacks/):
    model_checkpoint.ModelCheckpoint   early_stopping.EarlyStopping   progress_bar.progress_bar
    throughput_log.ThroughputLog       performance_log.PerformanceLog trace_steps.TraceSteps (debug=trace)
Added to every run by `hpctrain.runtime.run.build`:
    monitored_metric.MonitoredMetric   resume_state.ResumeState           attempt_progress.AttemptProgress
    shared_run_dir_check.SharedRunDirCheck   rank_watchdog.RankWatchdog           non_finite_loss.NonFiniteLoss
    requeue_on_signal.RequeueOnSignal  one_rank_calls.OneRankCalls          frozen_parts.FrozenParts

Nothing is imported here: a `_target_` imports only the module it names.
"""
