"""What a mistake's sentence suggests is what the user meant: a new key gets the `+` form, a misspelt key its
spelling (never its group's name), `key value` gets `key=value`, a misspelt `_target_` the class it most
likely names, and a checkpoint whose classes came from a `hydra.searchpath` folder the searchpath its
training run recorded. (The processes that print them: tests/test_bad_input.py and the newcomer's transcript
in tests/test_docs.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.config.hydra_errors import closest_key, describe_hydra_error, unparsed_override
from hpctrain.runtime.config.target_spelling import closest_target
from hpctrain.runtime.errors import UserError
from tests.helpers import EXAMPLES


def sentence(monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    """The sentence src/train.py prints for this command line (composed here, as Hydra composes it)."""
    monkeypatch.setattr(sys, "argv", ["src/train.py", *argv])
    with pytest.raises(Exception) as raised:
        compose("train", [a for a in argv if not a.startswith("-")])
    found = describe_hydra_error(raised.value, "train")
    assert found is not None, raised.value
    return found


def test_a_new_key_without_plus_gets_the_plus_form_first_not_a_neighbours_key(monkeypatch):
    swa = "callbacks.swa._target_=pytorch_lightning.callbacks.StochasticWeightAveraging"
    said = sentence(monkeypatch, "experiment=quickstart", swa)
    assert said.startswith(
        f"callbacks.swa._target_ is not a config key; to add it as a new key write +{swa} "
    )
    assert "progress" not in said and "did you mean" not in said


def test_a_groups_key_never_suggests_the_group(monkeypatch):
    said = sentence(monkeypatch, "trainer.foo=1")
    assert "trainer=1" not in said and "did you mean" not in said
    assert "write +trainer.foo=1" in said


def test_an_unknown_top_level_key_is_a_whole_sentence(monkeypatch):
    said = sentence(monkeypatch, "foo=1")
    assert said == (
        "foo is not a config key; to add it as a new key write +foo=1 "
        "(`python src/train.py --cfg job` shows every key)."
    )
    assert "; (" not in said


def test_a_misspelt_key_or_group_still_gets_its_spelling(monkeypatch):
    assert "did you mean trainer.max_epochs=3?" in sentence(monkeypatch, "trainer.max_epoch=3")
    assert "did you mean model=mlp?" in sentence(monkeypatch, "modle=mlp")


def test_closest_key_compares_part_by_part():
    keys = ["trainer", "trainer.max_epochs", "callbacks.progress._target_", "callbacks.progress.mode"]
    assert closest_key("trainer.max_epoch", keys) == "trainer.max_epochs"
    assert closest_key("callbacks.swa._target_", keys) is None
    assert closest_key("trainer.foo", keys) is None
    assert closest_key("callbacks.progres._target_", keys) == "callbacks.progress._target_"


@pytest.mark.parametrize(
    ("argv", "fixed", "bad"),
    [
        (["trainer.devices", "2"], "trainer.devices=2", "trainer.devices"),
        (["trainer.devices=", "2"], "trainer.devices=2", "2"),
        (["experiment=quickstart", "trainer.devices", "=", "2"], "trainer.devices=2", "trainer.devices"),
        (["--cfg", "job", "seed"], "seed=<value>", "seed"),
    ],
)
def test_key_space_value_says_write_key_equals_value(monkeypatch, argv, fixed, bad):
    said = sentence(monkeypatch, *argv)
    assert said == (
        f"cannot parse {bad!r}: an override is key=value, one word with no spaces around '='; write {fixed}."
    )


def test_an_override_that_does_not_parse_still_says_what_to_quote():
    said = unparsed_override(["trainer.devices=[1,"], "no viable alternative at input '[1,'")
    assert said.startswith("cannot parse 'trainer.devices=[1,' (no viable alternative")
    assert "quote values" in said


@pytest.mark.skipif(not EXAMPLES, reason="a project made without the examples has no ImageClassifier")
def test_a_misspelt_target_gets_the_projects_own_class():
    right = "myproject.models.classifier.ImageClassifier"
    assert closest_target("myproject.models.clasifier.ImageClassifier") == right  # the module
    assert closest_target("myproject.models.classifier.ImageClasifier") == right  # the class
    assert closest_target("myprojct.models.classifier.ImageClassifier") == right  # the package
    assert closest_target(right) is None  # nothing to correct
    assert closest_target("myproject.models.nothing_like_it.Net") is None
    assert closest_target("elsewhere.models.Net") is None  # not the project's: PYTHONPATH's sentence


def test_a_misspelt_target_in_an_installed_package_gets_its_name():
    # any installed package's (finding a module imports its parent packages; omegaconf's are imported already)
    assert closest_target("omegaconf.DictConfg") == "omegaconf.DictConfig"
    assert closest_target("omegaconf.dictconfg.DictConfig") == "omegaconf.dictconfig.DictConfig"


def test_a_refused_proposal_names_the_searchpath_its_training_run_recorded(tmp_path: Path):
    import torch

    from hpctrain.runtime.storage.checkpoints import reading

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'their_conf'}]"
    record = {"hydra": {"overrides": {"hydra": [searchpath, "hydra.mode=RUN"], "task": ["model=theirs"]}}}
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(record))  # as Hydra records a run
    checkpoint = run / "checkpoints" / "last.ckpt"
    assert reading.recorded_searchpath(checkpoint) == searchpath
    assert reading.recorded_searchpath(tmp_path / "elsewhere.ckpt") == ""

    stored = {"choices": {"model": "theirs"}, "model": {"_target_": "their_package.models.Net"}}
    torch.save({"state_dict": {}, reading.CONFIG_KEY: stored}, checkpoint)
    with pytest.raises(UserError) as refused:
        reading.config_from_checkpoint(OmegaConf.create({}), checkpoint, [])
    said = str(refused.value)
    assert "proposes model=theirs, which this project cannot compose" in said and "model=<option>" in said
    assert f"Its training run searched more configs: {searchpath}." in said
    elsewhere = tmp_path / "elsewhere.ckpt"
    torch.save({"state_dict": {}, reading.CONFIG_KEY: stored}, elsewhere)
    with pytest.raises(UserError) as refused:
        reading.config_from_checkpoint(OmegaConf.create({}), elsewhere, [])
    assert "searchpath" not in str(refused.value)  # a run that searched no other folder: nothing to pass
