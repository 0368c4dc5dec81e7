"""Every private name of Lightning, Hydra and torch that the template relies on, in one list.

A library's private names can change in any release. Each entry says where the template uses the name
and why no public API does the job, and `tests/test_internals.py` resolves every one of them, so an
upgrade that moves or renames one fails that test (and the behaviour test named here) at once, instead
of silently changing a run. Pinned versions: pyproject.toml / uv.lock. Lightning's names are written as
pytorch_lightning spells them and resolved in both of its namespaces (`hpctrain.runtime.namespaces`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    name: str  # module:attribute.path, resolvable by tests/test_internals.py
    used_in: str  # the template module that relies on it
    why: str
    test: str  # the behaviour test that fails if its meaning changes
    since: str | None = (
        None  # "torch 2.8": the oldest release of the window that has it (older: done without)
    )


INTERNALS = (
    Internal(
        "torch.distributed.distributed_c10d:_set_pg_timeout",
        "callbacks/rank_watchdog.py",
        "torch 2.6 has no public torch.distributed.set_timeout: dist.timeout_min after the first step",
        "tests/test_fsdp.py::test_the_device_meshs_groups_get_the_configured_collective_timeout",
    ),
    Internal(
        "torch._C._distributed_c10d:_dump_nccl_trace",
        "runtime/distributed/flight_recorder.py",
        "NCCL's flight record, written by each rank when hpctrain ends a hung job: torch writes it only at "
        "NCCL's own timeout, which hpctrain's watchdog comes before",
        "tests/test_hangs.py::test_a_rank_that_does_not_arrive_within_the_timeout_is_named_with_where_it_was",
    ),
    Internal(
        "torch._C._distributed_c10d:_dump_fr_trace",
        "runtime/distributed/flight_recorder.py",
        "as _dump_nccl_trace, for gloo's groups (CPU jobs)",
        "tests/test_hangs.py::test_a_rank_that_does_not_arrive_within_the_timeout_is_named_with_where_it_was",
        since="torch 2.8",
    ),
    Internal(
        "pytorch_lightning.trainer.connectors.logger_connector.logger_connector:_LoggerConnector.should_update_logs",
        "callbacks/throughput_log.py",
        "whether this step's logged values are written (Lightning's LearningRateMonitor asks it too)",
        "tests/test_llm.py::test_tokens_per_second_and_the_learning_rate_are_logged_per_log_interval",
    ),
    Internal(
        "hydra._internal.utils:run_and_report",
        "runtime/config/command_line.py",
        "Hydra reports composition errors through it; wrapped so a mistake is one sentence, exit 2",
        "tests/test_train.py::test_unknown_override_key_fails_naming_the_key",
    ),
    Internal(
        "hydra._internal.utils:_locate",
        "runtime/config/targets.py",
        "a `_target_` looked up exactly as Hydra's instantiate looks it up (hydra.utils.get_object logs an "
        "error before raising, which the one-sentence report replaces)",
        "tests/test_hydra_spellings.py::test_every_public_name_is_found_as_hydra_finds_it",
    ),
    Internal(
        "hydra._internal.hydra:Hydra",
        "runtime/config/command_line.py",
        "--help lists each group's options from its config repository once instead of deep-copying it per group",
        "tests/test_config.py::test_help_builds_one_config_repository",
    ),
    Internal(
        "hydra._internal.hydra:Hydra.app_help",
        "runtime/config/command_line.py",
        "--help, --hydra-help and --cfg job print their answer here; stored for the next identical question",
        "tests/test_config.py::test_a_repeated_question_is_answered_again_until_what_it_depends_on_changes",
    ),
    Internal(
        "hydra._internal.hydra:Hydra.hydra_help",
        "runtime/config/command_line.py",
        "as Hydra.app_help",
        "tests/test_config.py::test_a_repeated_question_is_answered_again_until_what_it_depends_on_changes",
    ),
    Internal(
        "hydra._internal.hydra:Hydra.show_cfg",
        "runtime/config/command_line.py",
        "as Hydra.app_help",
        "tests/test_config.py::test_a_repeated_question_is_answered_again_until_what_it_depends_on_changes",
    ),
    Internal(
        "hydra._internal.core_plugins.basic_sweeper:BasicSweeper.split_arguments",
        "runtime/sweeps/grid.py",
        "a job array expands the grid in Hydra's own job order",
        "tests/test_sweeps.py",
    ),
    Internal(
        "hydra.core.utils:JobReturn",
        "runtime/sweeps/slurm.py",
        "a failed launcher job carries its exception in JobReturn._return_value, as Hydra's own launchers do",
        "tests/test_slurm_sweeps.py",
    ),
    Internal(
        "torch.distributed.distributed_c10d:_get_default_store",
        "runtime/distributed/job_store.py",
        "the job's key-value store, where a failing rank or one whose data ran out records it for the others",
        "tests/test_faults.py::test_an_exception_in_one_rank_ends_the_job_naming_that_rank",
    ),
    Internal(
        "pytorch_lightning.strategies.model_parallel:ModelParallelStrategy._setup_distributed",
        "runtime/distributed/fsdp.py",
        "FSDP2's data-parallel size defaults to all processes over dist.tensor_parallel (Lightning's to the node count)",
        "tests/test_fsdp.py::test_a_sharded_run_resumed_mid_epoch_ends_as_the_uninterrupted_run",
    ),
    Internal(
        "torch.cuda.memory:_record_memory_history",
        "callbacks/trace_steps.py",
        "debug=trace's CUDA memory snapshot: torch's documented way to record one (no public name yet)",
        "tests/test_performance.py::test_a_trace_per_rank_under_ddp",
    ),
    Internal(
        "torch.cuda.memory:_dump_snapshot",
        "callbacks/trace_steps.py",
        "as _record_memory_history: writes the snapshot that pytorch.org/memory_viz reads",
        "tests/test_performance.py::test_a_trace_per_rank_under_ddp",
    ),
    Internal(
        "pytorch_lightning.strategies.launchers.subprocess_script:_SubprocessScriptLauncher._call_children_scripts",
        "runtime/distributed/launch.py",
        "local ranks are started per Hydra job (the same run dir, the composed config, no replayed sweep)",
        "tests/test_ddp.py",
    ),
    Internal(
        "pytorch_lightning.strategies:DDPStrategy._configure_launcher",
        "runtime/distributed/launch.py",
        "installs the Hydra-aware launcher in place of Lightning's",
        "tests/test_ddp.py",
    ),
    Internal(
        "pytorch_lightning.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers",
        "runtime/distributed/signals.py",
        "switched off: the template owns SIGTERM and the requeue signal (Lightning's handlers act inside the handler)",
        "tests/test_signals.py::test_lightning_still_has_what_the_template_switches_off",
    ),
    Internal(
        "pytorch_lightning.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor",
        "runtime/distributed/signals.py",
        "switched off: a broadcast at every training step that the template's agreed checks replace",
        "tests/test_signals.py::test_lightning_still_has_what_the_template_switches_off",
    ),
    Internal(
        "pytorch_lightning.loops.fit_loop:_FitLoop.setup_data",
        "callbacks/resume_state.py",
        "on resume the train loader built early by estimated_stepping_batches (fit_loop._combined_loader, "
        "fit_loop._data_fetcher) is dropped so Lightning rebuilds and restores it (Lightning #20550)",
        "tests/test_differential.py::test_onecycle_resumed_mid_epoch_ends_as_the_uninterrupted_run",
    ),
    Internal(
        "pytorch_lightning.loops.fit_loop:_FitLoop.on_load_checkpoint",
        "callbacks/resume_state.py",
        "under FSDP2 the early train loader is kept (the checkpoint is restored after on_fit_start); its saved "
        "position (fit_loop._combined_loader_states_to_load) is given to it at on_train_start",
        "tests/test_llm.py::test_a_run_resumed_mid_epoch_ends_as_the_uninterrupted_one",
    ),
    Internal(
        "pytorch_lightning.utilities.combined_loader:CombinedLoader._load_state_dicts",
        "callbacks/resume_state.py",
        "as _FitLoop.on_load_checkpoint: the saved loader position given to the loader built early",
        "tests/test_llm.py::test_a_run_resumed_mid_epoch_ends_as_the_uninterrupted_one",
    ),
    Internal(
        "pytorch_lightning.callbacks:ModelCheckpoint._save_last_checkpoint",
        "callbacks/model_checkpoint.py",
        "last.ckpt brought up to the current step at every epoch end (Lightning writes it only with a new best)",
        "tests/test_differential.py::test_early_stopping_leaves_the_last_epoch_in_last_ckpt",
    ),
    Internal(
        "pytorch_lightning.callbacks:ModelCheckpoint._monitor_candidates",
        "callbacks/model_checkpoint.py",
        "the metrics last.ckpt's name and state are formatted from",
        "tests/test_differential.py::test_early_stopping_leaves_the_last_epoch_in_last_ckpt",
    ),
    Internal(
        "pytorch_lightning.callbacks:ModelCheckpoint._should_save_on_train_epoch_end",
        "callbacks/model_checkpoint.py",
        "whether Lightning saves at the end of the training epoch or of validation: last.ckpt follows it",
        "tests/test_differential.py::test_user_code_behaves_as_under_bare_lightning",
    ),
    Internal(
        "pytorch_lightning.callbacks:ModelCheckpoint._save_topk_checkpoint",
        "callbacks/model_checkpoint.py",
        "a monitored metric missing after validation becomes one sentence",
        "tests/test_bring_your_own.py",
    ),
    Internal(
        "pytorch_lightning.callbacks:EarlyStopping._validate_condition_metric",
        "callbacks/early_stopping.py",
        "a monitored metric missing is one sentence instead of Lightning's RuntimeError",
        "tests/test_bring_your_own.py",
    ),
    Internal(
        "pytorch_lightning.callbacks:EarlyStopping._run_early_stopping_check",
        "callbacks/early_stopping.py",
        "with no monitored metric (monitor.metric=null, or a model that logs none) early stopping never stops",
        "tests/test_differential.py::test_a_model_that_logs_nothing_trains_with_last_ckpt_only",
    ),
    Internal(
        "pytorch_lightning.callbacks:ModelCheckpoint._every_n_train_steps",
        "callbacks/model_checkpoint.py",
        "with neither a step count nor a time interval (this and _train_time_interval), Lightning's per-step "
        "save check always answers no, so it is skipped",
        "tests/test_differential.py::test_user_code_behaves_as_under_bare_lightning",
    ),
    Internal(
        "pytorch_lightning.callbacks:ModelCheckpoint._train_time_interval",
        "callbacks/model_checkpoint.py",
        "see _every_n_train_steps",
        "tests/test_differential.py::test_user_code_behaves_as_under_bare_lightning",
    ),
    Internal(
        "lightning_fabric.strategies.launchers.subprocess_script:_ChildProcessObserver._child_processes",
        "runtime/distributed/launch.py",
        "Lightning's thread named child-process-observer SIGKILLs the main process when a local rank fails; "
        "emptied once hpctrain's watchdog watches the local ranks (it names the rank; the two raced)",
        "tests/test_lightning_semantics.py",
    ),
    Internal(
        "lightning_fabric.utilities.types:_Stateful",
        "runtime/storage/checkpoints/resume_state.py",
        "the protocol Lightning uses to decide whether a train loader resumes mid-epoch",
        "tests/test_bring_your_own.py::test_a_plain_dataloader_resumes_from_the_last_step_and_says_so",
    ),
    Internal(
        "torch.nn.modules.batchnorm:_BatchNorm",
        "callbacks/frozen_parts.py",
        "the base of every BatchNorm layer, whose statistics init_from.freeze keeps fixed",
        "tests/test_init_from.py::test_fine_tuning_starts_a_new_run_from_weights_and_freezes",
    ),
    Internal(
        "pytorch_lightning.loggers.csv_logs:ExperimentWriter._check_log_dir_exists",
        "loggers.py",
        "a resumed run appends to metrics.csv instead of Lightning deleting it",
        "tests/test_outputs.py::test_csv_logger_appends_when_a_run_continues",
    ),
    Internal(
        "torch.distributed.checkpoint.filesystem:_StorageInfo",
        "runtime/storage/checkpoints/sharded.py",
        "what a DCP index says of each stored item (shard file, offset, length, transforms): the index "
        "unpickler admits it by name, and every shard path and size is checked from it before a load",
        "tests/test_checkpoint_trust.py::test_the_index_unpickler_admits_exactly_what_dcp_writes",
    ),
    Internal(
        "torch.distributed.checkpoint.filesystem:FileSystemReader.load_id",
        "runtime/storage/checkpoints/sharded.py",
        "the parsed index handed to torch's reader carries the reader's load id, as its own read_metadata sets it",
        "tests/test_checkpoint_trust.py::test_a_sharded_folder_is_read_once_whatever_is_swapped_in_after",
    ),
)
