"""Every option of every config group composes, and what it describes can be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from hpctrain import build
from hpctrain.config_checks import check_config
from tests.helpers import ROOT, compose_train

CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "local")
OPTIONS = [(group, yaml.stem) for group in GROUPS for yaml in sorted((CONF / group).glob("*.yaml"))]
NEEDS_HARDWARE = {"gpu", "ddp", "mps"}


def test_every_group_has_options():
    assert {
        "data",
        "model",
        "trainer",
        "callbacks",
        "logger",
        "debug",
        "experiment",
        "paths",
        "hydra",
        "extras",
    } <= set(GROUPS)
    assert ("experiment", "quickstart") in OPTIONS and ("trainer", "ddp_cpu") in OPTIONS


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group: str, option: str, tmp_path: Path, mnist_dir: Path):
    if group == "hydra":
        overrides = []  # hydra/default is always on; composing the app config exercises it
    elif group == "trainer" and option in NEEDS_HARDWARE:
        # No GPU/MPS here: compose the option and build it with the CPU accelerator instead.
        overrides = [f"trainer={option}", "trainer.accelerator=cpu", "trainer.devices=1"]
    else:
        overrides = [f"{group}={option}"]
    if "mnist" in option:
        overrides.append("data.val_size=100")  # the generated files hold 600 training images
    cfg = compose_train(tmp_path, mnist_dir, *overrides)
    check_config(cfg)

    if group == "data":
        datamodule = instantiate(cfg.data)
        datamodule.check_available()
        datamodule.setup("fit")
        images, labels = next(iter(datamodule.train_dataloader()))
        assert images.dtype == torch.uint8 and images.shape[1:] == (1, 28, 28)
        assert len(images) == len(labels) == cfg.data.batch_size
    elif group == "model":
        model = instantiate(cfg.model)
        assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    elif group == "logger":
        loggers = build.loggers(cfg)
        assert loggers, f"logger={option} built nothing"
        for logger in loggers:
            logger.log_metrics({"probe": 1.0}, step=0)
            logger.save()
    else:
        trainer = build.trainer(cfg, tmp_path)
        assert trainer.max_epochs == cfg.trainer.max_epochs
        if group == "callbacks" and option == "default":
            names = {type(c).__name__ for c in trainer.callbacks}
            assert {"ModelCheckpoint", "EarlyStopping", "LearningRateMonitor", "ThroughputLog"} <= names


def test_ddp_cpu_is_ddp_with_two_processes(tmp_path: Path, mnist_dir: Path):
    cfg = compose_train(tmp_path, mnist_dir, "trainer=ddp_cpu")
    trainer = build.trainer(cfg, tmp_path)
    assert type(trainer.strategy).__name__ == "HydraDDPStrategy"
    assert trainer.strategy._start_method == "popen"  # "ddp" starts processes by script, not "ddp_spawn"
    assert trainer.world_size == 2 and trainer.num_devices == 2


def test_eval_config_composes(tmp_path: Path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[f"paths.output_dir={tmp_path}", "ckpt_path=x.ckpt"])
    assert cfg.ckpt_path == "x.ckpt" and "progress" in cfg.callbacks
