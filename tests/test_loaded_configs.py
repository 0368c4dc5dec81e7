"""The test processes read each config file once (tests/loaded_configs.py): what they compose is what
Hydra composes reading every file itself, and a file edited or added is read again."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hpctrain.runtime.config.compose import compose as compose_project
from hpctrain.runtime.config.versions import VERSION_BASE
from tests import loaded_configs


def test_this_hydra_has_what_the_store_relies_on():
    """A Hydra release without the private names leaves the tests reading every file again: slower, not
    wrong; this says so."""
    assert loaded_configs.install()


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["experiment=char_transformer", "trainer=ddp_cpu", "logger=many", "debug=fdr"],
        ["experiment=cifar10_resnet18", "model/scheduler=onecycle", "callbacks=[model_checkpoint,progress]"],
    ],
    ids=["defaults", "text-on-two-processes", "images-with-a-schedule"],
)
def test_a_composition_is_hydras_own(overrides: list[str]):
    composed = compose_project("train", overrides)
    assert loaded_configs.files_kept() > 0
    with loaded_configs.as_hydra_reads():
        read_by_hydra = compose_project("train", overrides)
    assert OmegaConf.to_yaml(composed) == OmegaConf.to_yaml(read_by_hydra)


def test_an_edited_or_added_config_file_is_read_again(tmp_path: Path):
    (tmp_path / "size").mkdir()
    (tmp_path / "main.yaml").write_text("defaults:\n  - size: small\n  - _self_\nname: main\n")
    (tmp_path / "size" / "small.yaml").write_text("width: 1\n")

    def width(*overrides: str) -> int:
        with initialize_config_dir(config_dir=str(tmp_path), **VERSION_BASE):
            return compose("main", list(overrides)).size.width

    assert width() == 1 and width() == 1
    (tmp_path / "size" / "small.yaml").write_text("width: 22\n")
    assert width() == 22
    (tmp_path / "size" / "large.yaml").write_text("width: 333\n")
    assert width("size=large") == 333
