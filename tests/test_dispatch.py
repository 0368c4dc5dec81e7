"""The template's callback dispatch skips only the base class's empty hooks; everything else is
Lightning's own behaviour. Fails when a Lightning release changes the function it replaces."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import pytest
from pytorch_lightning import Callback
from pytorch_lightning.trainer import call as lightning_call

from hpctrain import build, dispatch
from tests.helpers import compose_train

# pytorch-lightning 2.6.6's trainer.call._call_callback_hooks, which dispatch.py reimplements
LIGHTNING_SOURCE_SHA256 = "c413fb9a6a9ce1a31d0c48ce381076ae9113f5db9862e5a5c58e95c7282ba2f3"


def test_lightning_dispatch_is_the_one_reimplemented():
    source = inspect.getsource(dispatch._lightning_call_callback_hooks)
    assert hashlib.sha256(source.encode()).hexdigest() == LIGHTNING_SOURCE_SHA256, (
        "pytorch_lightning.trainer.call._call_callback_hooks changed: compare it with hpctrain/dispatch.py"
    )
    assert lightning_call._call_callback_hooks is dispatch._call_callback_hooks


class _Recorder(Callback):
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append((self.name, pl_module._current_fx_name, batch_idx))

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.log("recorded", float(len(self.calls)))  # self.log from a callback still works


@pytest.mark.slow
def test_implemented_hooks_run_in_order_with_their_arguments(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, "data=digits", "trainer=cpu", "trainer.max_epochs=1")
    calls: list = []
    trainer = build.trainer(cfg, tmp_path, logger=False, limit_train_batches=3, limit_val_batches=1)
    trainer.callbacks.extend([_Recorder("a", calls), _Recorder("b", calls)])
    trainer.fit(build.model(cfg), build.datamodule(cfg))
    assert calls == [(name, "on_train_batch_end", i) for i in range(3) for name in ("a", "b")]
    assert float(trainer.callback_metrics["recorded"]) == 6.0
