"""The config schema: values are checked before torch is imported, the editor schema is the same table,
and the lists copied from Lightning match Lightning's."""

from __future__ import annotations

import importlib.util
import typing
from pathlib import Path

import jsonschema
import pytest
import yaml

from hpctrain.runtime.config.compose import CONF_DIR, group_options
from hpctrain.runtime.config.schema import FILE_PREFIXES, KEYS, PRECISIONS, json_schema, validate
from tests.helpers import ROOT


def test_precisions_are_lightnings_own():
    from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT

    def flatten(tp):
        args = typing.get_args(tp)
        return [v for a in args for v in flatten(a)] if args else [tp]

    lightning = {str(v) for v in flatten(_PRECISION_INPUT) if "transformer-engine" not in str(v)}
    assert lightning == set(PRECISIONS)


@pytest.mark.parametrize(
    ("key", "good", "bad"),
    [
        ("trainer.devices", [2, -1, "auto", "0,1", [0, 1]], [0, "two", [], True]),
        ("trainer.max_epochs", [-1, 0, 10], [-2, 1.5, "ten", True]),
        ("model.optimizer.lr", [1e-3, 1], [0, -0.1, "fast"]),
        ("trainer.precision", ["bf16-mixed", 32, "64-true"], ["8-mixed", 8]),
        ("requeue.check_every_n_steps", [1, "auto"], [0, "often"]),
        ("monitor.mode", ["min", "max"], ["maximum", None]),
    ],
)
def test_schema_accepts_and_refuses(key, good, bad):
    schema = next(k.schema for k in KEYS if k.path == key)
    assert all(validate(v, schema) for v in good)
    assert not any(validate(v, schema) for v in bad)


def test_editor_schemas_are_up_to_date(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`python scripts/dev/config_schema.py --check`, run in this process."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "dev"))  # its own import (generated)
    monkeypatch.setattr("sys.argv", ["scripts/dev/config_schema.py", "--check"])
    spec = importlib.util.spec_from_file_location(
        "config_schema", ROOT / "scripts" / "dev" / "config_schema.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main() == 0, capsys.readouterr().err


def test_every_config_file_validates_against_its_editor_schema():
    checked = 0
    for group, prefix in FILE_PREFIXES.items():
        schema = json_schema(prefix)
        jsonschema.Draft202012Validator.check_schema(schema)
        files = (
            [CONF_DIR / "train.yaml", CONF_DIR / "eval.yaml", CONF_DIR / "export.yaml"]
            if group == "train"
            else group_options(group).values()
        )
        for path in files:
            content = yaml.safe_load(Path(path).read_text()) or {}
            if "@package _global_" in Path(path).read_text() and prefix:
                continue  # a global file describes the whole config, not this group
            jsonschema.validate(content, schema)
            checked += 1
    assert checked > 15
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"max_epochs": "ten"}, json_schema("trainer."))
