"""Your configs are trusted code, and their names resolve as Hydra resolves them: `torch.nn.Linear` (a
re-export), `torch.optim.Adam` with `_partial_`, `torch.nn.Sequential` with `_args_`, a classmethod such as
`LightningDataModule.from_datasets`.

Generated from the rule, not from a list of cases: every public name of the packages Hydra users name in
their configs is found by the template exactly as Hydra's own lookup finds it, and a config written as
Hydra's tutorials write it builds the same objects through the template as through plain Hydra, in a
composed project config too. (What a received file may name is another rule: tests/test_checkpoint_trust.py.)
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from hydra._internal.utils import _locate
from hydra.utils import instantiate as hydra_instantiate
from omegaconf import OmegaConf

from hpctrain.runtime.config import targets
from hpctrain.runtime.errors import UserError
from tests.helpers import compose_train

# the packages whose names Hydra users write in their configs, by the public names each declares
PACKAGES = (
    "torch.nn",
    "torch.optim",
    "torch.optim.lr_scheduler",
    "torch.utils.data",
    "torchmetrics",
    "torchvision.models",
    "torchvision.transforms",
    "pytorch_lightning",
    "pytorch_lightning.callbacks",
    "pytorch_lightning.loggers",
    "lightning.pytorch",
    "lightning.pytorch.callbacks",
)


def public_names() -> list[str]:
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        declared = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in declared:
            obj = getattr(module, name, None)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                names.append(f"{package}.{name}")
                if inspect.isclass(obj):  # its classmethods: a target Hydra users write too
                    names += [
                        f"{package}.{name}.{attribute}"
                        for attribute, member in vars(obj).items()
                        if isinstance(member, classmethod) and not attribute.startswith("_")
                    ]
    return names


def test_every_public_name_is_found_as_hydra_finds_it():
    names = public_names()
    reexported = [n for n in names if n.count(".") >= 2 and _locate(n).__module__ != n.rsplit(".", 1)[0]]
    assert len(names) > 500 and len(reexported) > 300, (len(names), len(reexported))  # torch.nn.Linear...
    for name in names:
        found, hydras = targets.locate(name), _locate(name)
        # a bound classmethod is a new object at each access: the same method of the same class
        assert found == hydras or _named(found) == _named(hydras), name


def _named(obj: object) -> tuple[str, str]:
    return getattr(obj, "__module__", ""), getattr(obj, "__qualname__", "")


def test_a_misspelt_name_is_one_sentence_with_the_name_it_means():
    for wrong, meant in [
        ("torch.nn.Flaten", "torch.nn.Flatten"),
        ("torch.optim.Addam", "torch.optim.Adam"),
        ("myproject.models.classifer.ImageClassifier", "myproject.models.classifier.ImageClassifier"),
    ]:
        with pytest.raises(
            UserError, match=rf"_target_: {wrong} cannot be imported .*did you mean {meant}\?"
        ):
            targets.locate(wrong)


HYDRA_STYLE = {
    "net": {
        "_target_": "torch.nn.Sequential",
        "_args_": [
            {"_target_": "torch.nn.Flatten"},
            {"_target_": "torch.nn.Linear", "in_features": 64, "out_features": 32},
            {"_target_": "torch.nn.ReLU"},
            {"_target_": "torch.nn.Linear", "in_features": 32, "out_features": 10},
        ],
    },
    "loss": {"_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1},
    "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.01},
    "data": {
        "_target_": "pytorch_lightning.LightningDataModule.from_datasets",
        "train_dataset": {"_target_": "torchvision.datasets.FakeData", "size": 8, "image_size": [1, 8, 8]},
        "batch_size": 4,
    },
}


@pytest.mark.parametrize("key", sorted(HYDRA_STYLE))
def test_a_config_as_hydra_users_write_it_builds_what_plain_hydra_builds(key: str):
    node = OmegaConf.create(HYDRA_STYLE[key])
    mine, theirs = targets.instantiate(node, _convert_="all"), hydra_instantiate(node, _convert_="all")
    assert type(mine) is type(theirs)
    if key == "optimizer":
        assert (mine.func, mine.keywords) == (theirs.func, theirs.keywords)
    elif key == "data":
        assert len(mine.train_dataloader().dataset) == len(theirs.train_dataloader().dataset) == 8
    else:
        assert repr(mine) == repr(theirs)


def test_a_projects_net_in_hydras_spelling_builds_into_its_model(tmp_path: Path):
    """A file of the user's own under conf/ (here a searchpath folder), written as every Hydra tutorial
    writes it, composed and built by the template's build path."""
    from hpctrain.runtime.run import build

    folder = tmp_path / "conf"
    (folder / "model" / "net").mkdir(parents=True)
    (folder / "model" / "net" / "hydra_mlp.yaml").write_text(OmegaConf.to_yaml(HYDRA_STYLE["net"]))
    cfg = compose_train(
        tmp_path,
        tmp_path,
        f"hydra.searchpath=[file://{folder}]",
        "experiment=quickstart",
        "model/net=hydra_mlp",
    )
    model = build.model(cfg)
    assert repr(model.net) == repr(hydra_instantiate(OmegaConf.create(HYDRA_STYLE["net"])))
