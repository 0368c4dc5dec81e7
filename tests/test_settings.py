"""hpctrain's own settings are typed and checked once: an unknown key or a wrong value in any of its
sections, a cluster preset's included, is one sentence naming the key, the file that set it and the
closest real key; the code reads attributes, and the schema's table comes from the same definitions."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from hpctrain.runtime.config import schema
from hpctrain.runtime.config.settings import Cluster, Settings, Sources, all_keys
from hpctrain.runtime.errors import UserError
from tests.helpers import compose_train


def test_the_composed_config_gives_typed_settings(tmp_path: Path, data_dir: Path):
    cfg = compose_train(
        tmp_path, data_dir, "experiment=quickstart", "requeue.max_attempts=3", "cluster=local"
    )
    settings = Settings.of(cfg)
    assert settings.requeue.max_attempts == 3 and settings.requeue.signal == "SIGUSR1"
    assert settings.dist.fsdp.shard == "auto" and settings.dist.startup_timeout_min == 30
    assert settings.cluster is not None and settings.cluster.partition == "debug"
    assert settings.monitor is not None and settings.monitor.metric == "val/acc"


def test_a_typo_in_a_section_names_the_key_the_file_and_the_fix(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, "experiment=quickstart")
    with open_dict(cfg):
        cfg.requeue.max_attempt = 3  # as a site's config file might spell it
    hydra = OmegaConf.create(
        {"runtime": {"choices": {"experiment": "quickstart"}}, "job": {"config_name": "train"}}
    )
    with pytest.raises(UserError) as refused:
        Settings.of(cfg, Sources(hydra))
    assert str(refused.value) == (
        "requeue.max_attempt is not a key of requeue (set in conf/train.yaml); did you mean requeue.max_attempts?"
    )
    with pytest.raises(
        UserError,
        match=r"is not a key of dist.fsdp \(set in the command line\); did you mean dist.fsdp.shard\?",
    ):
        Settings.of(
            OmegaConf.create({"dist": {"fsdp": {"shards": "auto"}}}),
            Sources(hydra, ["dist.fsdp.shards=auto"]),
        )


def test_a_cluster_presets_typo_or_wrong_value_is_refused_naming_its_file(tmp_path: Path):
    preset = tmp_path / "mysite.yaml"
    preset.write_text("name: mysite\npartition: gpu\ngpus_per_nod: 4\n")
    with pytest.raises(
        UserError,
        match=r"cluster.gpus_per_nod is not a key of cluster \(set in .*mysite.yaml\); did you mean cluster.gpus_per_node\?",
    ):
        Cluster.load(preset)
    preset.write_text("name: mysite\ngpus_per_node: four\n")
    with pytest.raises(
        UserError, match=r"cluster.gpus_per_node='four' is not a non-negative integer .*mysite.yaml"
    ):
        Cluster.load(preset)
    preset.write_text("name: mysite\ngpus_per_node: 4\ntasks_per_node: 4\n")
    assert Cluster.load(preset).gpus_per_node == 4


def test_the_schema_table_holds_every_setting_once():
    paths = [key.path for key in schema.KEYS]
    assert len(paths) == len(set(paths))
    assert {path for path, _ in all_keys()} <= set(paths)
