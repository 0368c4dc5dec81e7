"""The schema of the user-facing config keys: one table that both checks a composed config (before
torch is imported) and becomes the JSON Schema editors use to complete and validate conf/*.yaml.

Each key has a JSON Schema fragment (type, range, allowed values), the sentence that says what is
allowed, and an example value. `validate` implements the part of JSON Schema the table uses, so the
runtime check and the editor schema cannot disagree; `scripts/dev/config_schema.py` writes conf/schema/.
hpctrain's own keys are defined once, as its typed settings (`settings.all_keys`); `GROUP_KEYS` adds
the keys of the groups handed on whole that hpctrain checks. Keys the table does not name are Lightning's
or your classes' own and are checked where they are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.runtime.config import settings
from hpctrain.runtime.config.settings import ACCELERATORS, POSITIVE_NUMBER, PRECISIONS, integer
from hpctrain.runtime.config.validation import validate

__all__ = ["ACCELERATORS", "KEYS", "PRECISIONS", "Key", "json_schema", "validate"]

EXPORT_FORMATS = (
    "torch_export",
    "onnx",
    "safetensors",
    "peft",
    "hf_merged",
)  # src/export.py (hpctrain.runtime.inference.export)
INTERPOLATION = {"type": "string", "pattern": r"^\$\{.*\}$"}  # ${...}: resolved later, checked then
NOTIFY_EVENTS = settings.NOTIFY_EVENTS  # hpctrain.runtime.distributed.notify's events (tests/test_notify.py)


@dataclass(frozen=True)
class Key:
    path: str
    schema: dict[str, Any]
    expected: str
    example: str
    description: str = ""


# The keys of the groups hpctrain hands on whole (Lightning's trainer, the user's data and model, export's,
# paths): checked, not typed; hpctrain's own keys (predict's, and the trainer's it reads) are its typed
# settings'
GROUP_KEYS: tuple[Key, ...] = (
    Key("trainer.max_epochs", integer(-1), "an integer, -1 or more (-1: no limit)", "10"),
    Key("trainer.min_epochs", {"type": ["integer", "null"], "minimum": 0}, "a non-negative integer", "1"),
    Key("trainer.max_steps", integer(-1), "an integer, -1 or more (-1: no limit)", "1000"),
    Key("trainer.log_every_n_steps", integer(1), "a positive integer", "50"),
    Key(
        "trainer.accumulate_grad_batches",
        integer(1),
        "a positive integer",
        "4",
        "optimizer step every N batches",
    ),
    Key(
        "trainer.gradient_clip_val",
        {"type": ["number", "null"], "minimum": 0},
        "a non-negative number or null",
        "1.0",
        "clip gradients to this norm",
    ),
    Key("trainer.num_sanity_val_steps", integer(-1), "an integer, -1 or more", "2"),
    Key(
        "trainer.check_val_every_n_epoch",
        {"type": ["integer", "null"], "minimum": 1},
        "a positive integer",
        "1",
    ),
    Key("trainer.deterministic", {"enum": [True, False, "warn", None]}, "true, false or warn", "true"),
    Key("data.batch_size", integer(1), "a positive integer", "64", "per process (per GPU)"),
    Key(
        "data.num_workers",
        {"anyOf": [integer(0), {"const": "auto"}]},
        "a non-negative integer or auto",
        "4",
        "auto: the CPUs less one for datamodules that decode files, else 0",
    ),
    Key("data.pin_memory", {"type": ["boolean", "null"]}, "true, false or null", "true", "null: on for GPUs"),
    Key(
        "data.num_folds",
        {"anyOf": [integer(2), {"const": 0}, {"type": "null"}]},
        "an integer, 2 or more, or null (0: off, as null)",
        "5",
        "k-fold cross-validation: the training data dealt into this many folds",
    ),
    Key(
        "data.fold",
        {"type": ["integer", "null"], "minimum": 0},
        "a non-negative integer or null",
        "0",
        "k-fold: the fold validated on (0 to data.num_folds-1)",
    ),
    Key(
        "data.fold_seed",
        integer(0),
        "a non-negative integer",
        "0",
        "k-fold: which samples fall in which fold",
    ),
    Key("model.optimizer.lr", POSITIVE_NUMBER, "a positive number", "0.001", "learning rate"),
    Key(
        "export.format",
        {"enum": list(EXPORT_FORMATS)},
        f"one of {', '.join(EXPORT_FORMATS)}",
        "onnx",
        "what src/export.py writes",
    ),
    Key(
        "export.output",
        {"type": ["string", "null"]},
        "a file path or null",
        "model.onnx",
        "the file src/export.py writes; null: <run dir>/model.<the format's suffix>",
    ),
    Key(
        "export.batch_size",
        integer(2),
        "an integer, 2 or more (traced on a batch of 1, the export would take only batches of 1)",
        "2",
        "the example batch the export is traced with; the exported model takes any batch size",
    ),
    Key("paths.data_dir", {"type": "string"}, "a directory", "/shared/datasets"),
    Key("paths.log_dir", {"type": "string"}, "a directory", "/shared/logs"),
)
KEYS: tuple[Key, ...] = GROUP_KEYS + tuple(
    Key(path, meta["schema"], meta["expected"], meta["example"], meta["description"])
    for path, meta in settings.all_keys()
)


# ------------------------------------------------------------------------------------------ JSON Schema

# Which part of the config each conf/ file describes: its directory (the config group) -> key prefix.
# Files of `@package _global_` groups (experiment, debug, local) and train.yaml describe the whole config.
FILE_PREFIXES = {
    "train": "",
    "trainer": "trainer.",
    "data": "data.",
    "model": "model.",
    "model/optimizer": "model.optimizer.",
    "paths": "paths.",
    "cluster": "cluster.",
}


def json_schema(prefix: str = "") -> dict[str, Any]:
    """A JSON Schema for a config file that holds the keys under `prefix` ("" for the whole config)."""
    root: dict[str, Any] = {"type": "object", "properties": {}}
    for key in KEYS:
        if not key.path.startswith(prefix):
            continue
        *parents, leaf = key.path[len(prefix) :].split(".")
        node = root
        for part in parents:
            node = node["properties"].setdefault(part, {"type": "object", "properties": {}})
        description = f"{key.description}; {key.expected}" if key.description else key.expected
        node["properties"][leaf] = {
            "description": description,
            "anyOf": [key.schema, INTERPOLATION],
            "examples": [key.example],
        }
    root["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    root["title"] = f"{prefix.rstrip('.') or 'the whole'} config (conf/)"
    return root
