"""A config key the target's class does not take is one sentence when the model or data is built (not a
TypeError inside configure_optimizers once the data is set up)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpctrain.runtime.config.arguments import check_arguments
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run import build
from tests.helpers import compose_train


def test_an_optimizer_key_left_by_an_experiment_for_another_optimizer_is_one_sentence(tmp_path: Path):
    cfg = compose_train(
        tmp_path, tmp_path, "experiment=quickstart", "model/optimizer=adamw", "+model.optimizer.momentum=0.9"
    )
    with pytest.raises(UserError) as refused:
        build.model(cfg.model)
    assert str(refused.value).startswith(
        "model.optimizer.momentum=0.9 is not an argument of torch.optim.AdamW (it takes params, lr, betas, "
    )
    assert (
        "remove it (~model.optimizer.momentum: an experiment or option written for another optimizer"
        in str(refused.value)
    )


def test_several_unknown_keys_are_named_together_and_kwargs_targets_are_left_alone():
    node = OmegaConf.create(
        {
            "scheduler": {
                "_target_": "torch.optim.lr_scheduler.StepLR",
                "_partial_": True,
                "gamma": 0.5,
                "a": 1,
                "b": 2,
            },
            "free": {"_target_": "builtins.dict", "anything": 1},  # dict(**kwargs) takes any key
        }
    )
    with pytest.raises(UserError, match=r"model.scheduler.a=1 and model.scheduler.b=2 are not arguments of"):
        check_arguments(node, "model")
    del node.scheduler.a, node.scheduler.b
    check_arguments(node, "model")  # step_size is missing, which calling the partial supplies or says
