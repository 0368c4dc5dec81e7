"""The template owns the signals: Lightning's own handlers and its per-step SIGTERM broadcast are off
for the template's trainers. These tests fail when a Lightning release moves what is switched off."""

from __future__ import annotations

import inspect
import signal
from pathlib import Path

import pytest
from pytorch_lightning import Callback
from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop
from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector

from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.distributed import signals
from hpctrain.runtime.run import build
from tests.helpers import compose_train


def test_lightning_still_has_what_the_template_switches_off():
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    assert "dist.broadcast" in inspect.getsource(_SignalConnector._sigterm_notifier_fn)
    assert callable(_SignalConnector.register_signal_handlers)


class _HandlersDuringFit(Callback):
    seen: dict[str, object] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen["SIGTERM"] = signal.getsignal(signal.SIGTERM)
        self.seen["SIGUSR1"] = signal.getsignal(signal.SIGUSR1)
        self.seen["broadcast"] = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor


@pytest.mark.slow
def test_during_fit_the_handlers_are_the_templates(tmp_path: Path, data_dir: Path):
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        signals.install("SIGUSR1")
        cfg = compose_train(tmp_path, data_dir, "data=digits", "debug=fdr", "trainer=cpu")
        spy = _HandlersDuringFit()
        trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
        trainer.callbacks.append(spy)
        trainer.fit(build.model(cfg.model), build.datamodule(cfg.data, Settings.of(cfg)))
        assert spy.seen["SIGTERM"] is signals._record and spy.seen["SIGUSR1"] is signals._record
        assert (
            getattr(spy.seen["broadcast"], "__func__", None)
            is not _TrainingEpochLoop._broadcast_sigterm_tensor
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_signal_after_the_run_completed_is_noted_and_ignored_until_the_process_ends(
    capsys: pytest.CaptureFixture[str],
):
    """SLURM's time-limit warning can come late, while a job that did all its work tears down: it is
    noted and ends nothing; for the interpreter's end the signals are ignored, which CPython keeps
    through its finalization (a handler it replaces by the default action, which kills)."""
    previous = {s: signal.getsignal(s) for s in signals.EARLY}
    try:
        signals.completed()
        for sig in signals.EARLY:
            signal.raise_signal(sig)  # the default action of each would end this process
        noted = capsys.readouterr().err.splitlines()
        assert noted == [
            f"note: {sig.name} arrived after the run completed; its work is saved, so the process ends normally."
            for sig in signals.EARLY
        ]
        signals.ignored_until_exit()
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in signals.EARLY)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("returncode", "ends_with"),
    [(-signal.SIGTERM, None), (1, 1)],
    ids=["scontrol ended by the requeue", "scontrol refused"],
)
def test_a_requeue_whose_scontrol_slurm_ends_first_is_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, returncode: int, ends_with: int | None
):
    """SLURM ends a requeued job's processes, and the `scontrol requeue` that asked may be the first it
    ends (a job with nothing left to train requeues within the second): the attempt waits to be ended as
    a requeued one. Only scontrol's own refusal (a positive status) ends the process with status 1."""
    import subprocess

    from hpctrain.runtime.distributed import requeue
    from hpctrain.runtime.environment import slurm_job

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    for name in ("RANK", "SLURM_PROCID", "PMI_RANK", requeue.launched.PACK_POINT):
        monkeypatch.delenv(name, raising=False)
    done = subprocess.CompletedProcess(["scontrol", "requeue", "42"], returncode, stdout="", stderr="")
    monkeypatch.setattr(slurm_job, "requeue_job", lambda: done)
    monkeypatch.setattr(requeue.signal_module, "signal", lambda *args: None)  # the test's own handlers stay
    caplog.set_level("INFO", logger=requeue.log.name)
    monkeypatch.setattr(requeue.log, "handlers", [caplog.handler])  # (hpctrain's loggers may not propagate)
    interrupted = signals.Interrupted(signals.REQUEUE, None, "during training")
    assert interrupted.requeue
    if ends_with is None:
        requeue.requeue_and_wait(interrupted, wait_s=0)
        assert "requeued SLURM job 42" in caplog.text and "failed" not in caplog.text
    else:
        with pytest.raises(SystemExit) as ended:
            requeue.requeue_and_wait(interrupted, wait_s=0)
        assert ended.value.code == ends_with and "scontrol requeue 42 failed" in caplog.text
