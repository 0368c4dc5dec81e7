"""The schema of the user-facing config keys: one table that both checks a composed config (before
torch is imported) and becomes the JSON Schema editors use to complete and validate conf/*.yaml.

Each key has a JSON Schema fragment (type, range, allowed values), the sentence that says what is
allowed, and an example value. `validate` implements the part of JSON Schema the table uses, so the
runtime check and the editor schema cannot disagree; `scripts/dev/config_schema.py` writes conf/schema/.
Keys the table does not name are Lightning's or your classes' own and are checked where they are used.
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass
from typing import Any

# Lightning's precision values (lightning_fabric's _PRECISION_INPUT, without transformer-engine, which
# needs NVIDIA's library); tests/test_schema.py fails if Lightning's list changes.
PRECISIONS = (
    "64",
    "64-true",
    "32",
    "32-true",
    "16",
    "16-mixed",
    "16-true",
    "bf16",
    "bf16-mixed",
    "bf16-true",
)
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
EXPORT_FORMATS = ("torch_export", "onnx", "safetensors")  # src/export.py (hpctrain.runtime.inference.export)
INTERPOLATION = {"type": "string", "pattern": r"^\$\{.*\}$"}  # ${...}: resolved later, checked then
# hpctrain.runtime.distributed.notify's events (tests/test_notify.py checks they are the same)
NOTIFY_EVENTS = ("completed", "failed", "nan", "hung", "budget", "sweep")


def _int(minimum: int | None = None) -> dict[str, Any]:
    return {"type": "integer"} | ({"minimum": minimum} if minimum is not None else {})


POSITIVE_NUMBER = {"type": "number", "exclusiveMinimum": 0}


@dataclass(frozen=True)
class Key:
    path: str
    schema: dict[str, Any]
    expected: str
    example: str
    description: str = ""


KEYS: tuple[Key, ...] = (
    Key(
        "seed",
        {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},  # numpy's seeds are 32-bit
        "an integer from 0 to 4294967295",
        "42",
        "seeds torch, numpy, python and dataloader workers",
    ),
    Key("train", {"type": "boolean"}, "true or false", "true", "fit the model"),
    Key("test", {"type": "boolean"}, "true or false", "false", "test the best checkpoint after fit"),
    Key(
        "ckpt_path",
        {"type": ["string", "null"]},
        "a checkpoint file, last, or null",
        "last",
        "start from this checkpoint (last: the newest last.ckpt of this task's runs)",
    ),
    Key("snapshot", {"type": "boolean"}, "true or false", "false", "launcher jobs run from a code snapshot"),
    Key(
        "init_from.path",
        {"type": ["string", "null"]},
        "a checkpoint, a .pt/.pth state dict, a .safetensors file, or null",
        "logs/train/runs/<run>/checkpoints/last.ckpt",
        "start a new run from these weights",
    ),
    Key("init_from.strict", {"type": "boolean"}, "true or false", "false", "false: load what fits"),
    Key(
        "init_from.prefix",
        {"type": "string"},
        "a string put in front of every key",
        "net.",
        "maps a bare network",
    ),
    Key(
        "init_from.exclude",
        {"type": "array", "items": {"type": "string"}},
        "a list of regular expressions (in brackets)",
        "['^net[.]fc[.]']",
        "keys left out of the weights loaded",
    ),
    Key(
        "init_from.freeze",
        {"type": "array", "items": {"type": "string"}},
        "a list of regular expressions (in brackets)",
        "['^net[.]features[.]']",
        "parameters not trained",
    ),
    Key(
        "init_from.unfreeze_at_epoch",
        {"type": ["integer", "null"], "minimum": 0},
        "a non-negative integer or null",
        "3",
        "the frozen parameters train too from this epoch on",
    ),
    Key(
        "skip_completed",
        {"type": "boolean"},
        "true or false",
        "true",
        "a re-run sweep skips completed points",
    ),
    Key("compile", {"type": "boolean"}, "true or false", "true", "torch.compile the model's networks"),
    Key("compile_backend", {"type": "string"}, "a torch.compile backend", "inductor"),
    Key("channels_last", {"type": "boolean"}, "true or false", "true", "channels-last memory order for CNNs"),
    Key("monitor.metric", {"type": ["string", "null"]}, "a metric name the model logs", "val/acc"),
    Key(
        "monitor.mode",
        {"enum": ["min", "max"]},
        "min or max",
        "max",
        "whether a larger monitored value is better",
    ),
    Key("trainer.num_nodes", _int(1), "a positive integer", "2", "nodes (SLURM: --nodes)"),
    Key(
        "trainer.devices",
        {
            "anyOf": [
                _int(1),
                {"const": -1},
                {"const": "auto"},
                {"type": "string", "pattern": r"^\s*\d+\s*(,\s*\d+\s*)*,?\s*$"},
                {"type": "array", "items": _int(0), "minItems": 1},
            ]
        },
        "a positive integer, -1, auto, or a list of device ids",
        "2",
        "processes per node: GPUs per node (SLURM: --ntasks-per-node)",
    ),
    Key("trainer.accelerator", {"enum": list(ACCELERATORS)}, f"one of {', '.join(ACCELERATORS)}", "cpu"),
    Key(
        "trainer.precision",
        {"enum": [*PRECISIONS, 64, 32, 16]},
        f"one of {', '.join(PRECISIONS)}",
        "bf16-mixed",
        "32-true; bf16-mixed or 16-mixed on GPUs",
    ),
    Key("trainer.max_epochs", _int(-1), "an integer, -1 or more (-1: no limit)", "10"),
    Key("trainer.min_epochs", {"type": ["integer", "null"], "minimum": 0}, "a non-negative integer", "1"),
    Key("trainer.max_steps", _int(-1), "an integer, -1 or more (-1: no limit)", "1000"),
    Key("trainer.log_every_n_steps", _int(1), "a positive integer", "50"),
    Key(
        "trainer.accumulate_grad_batches",
        _int(1),
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
    Key("trainer.num_sanity_val_steps", _int(-1), "an integer, -1 or more", "2"),
    Key(
        "trainer.check_val_every_n_epoch",
        {"type": ["integer", "null"], "minimum": 1},
        "a positive integer",
        "1",
    ),
    Key("trainer.deterministic", {"enum": [True, False, "warn", None]}, "true, false or warn", "true"),
    Key("data.batch_size", _int(1), "a positive integer", "64", "per process (per GPU)"),
    Key(
        "data.num_workers",
        {"anyOf": [_int(0), {"const": "auto"}]},
        "a non-negative integer or auto",
        "4",
        "auto: the CPUs less one for datamodules that decode files, else 0",
    ),
    Key(
        "num_threads",
        {"anyOf": [_int(1), {"const": "auto"}, {"type": "null"}]},
        "a positive integer or auto",
        "4",
        "torch's intra-op threads per process; auto: the process's CPUs less its loader workers",
    ),
    Key("data.pin_memory", {"type": ["boolean", "null"]}, "true, false or null", "true", "null: on for GPUs"),
    Key(
        "data.num_folds",
        {"anyOf": [_int(2), {"const": 0}, {"type": "null"}]},
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
    Key("data.fold_seed", _int(0), "a non-negative integer", "0", "k-fold: which samples fall in which fold"),
    Key("model.optimizer.lr", POSITIVE_NUMBER, "a positive number", "0.001", "learning rate"),
    Key("requeue.enabled", {"type": "boolean"}, "true or false", "true"),
    Key(
        "requeue.signal",
        {"enum": sorted(s.name for s in signal.Signals)},
        "a signal name such as SIGUSR1",
        "SIGUSR1",
        "must match #SBATCH --signal",
    ),
    Key(
        "requeue.check_every_n_steps",
        {"anyOf": [_int(1), {"const": "auto"}]},
        "a positive integer or auto",
        "auto",
        "how often ranks agree on signals; auto: about once a second",
    ),
    Key(
        "requeue.max_attempts",
        {"type": ["integer", "null"], "minimum": 1},
        "a positive integer or null (no cap)",
        "10",
        "attempt N of a SLURM job stops instead of requeueing again",
    ),
    Key(
        "requeue.signal_lead_s",
        POSITIVE_NUMBER,
        "a positive number of seconds",
        "90",
        "how long before the time limit the signal comes: the N of #SBATCH --signal=SIGUSR1@N",
    ),
    Key(
        "nan.action", {"enum": ["stop", "off"]}, "stop or off", "off", "what a non-finite training loss does"
    ),
    Key("nan.check_every_n_steps", _int(1), "a positive integer", "100", "steps between looks at the loss"),
    Key(
        "notify.url_env",
        {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
        "the name of an environment variable (the URL itself stays in the environment)",
        "HPCTRAIN_NOTIFY_URL",
        "the variable holding the webhook URL; notifications are on where it is set",
    ),
    Key(
        "notify.timeout_s",
        POSITIVE_NUMBER,
        "a positive finite number of seconds",
        "5",
        "the longest a notification may delay the end of a process",
    ),
    Key(
        "notify.events",
        {"type": "array", "items": {"enum": list(NOTIFY_EVENTS)}},
        f"a list of {', '.join(NOTIFY_EVENTS)}",
        "[failed,hung]",
        "the events posted to the webhook",
    ),
    Key(
        "diagnostics.stacks_signal",
        {"enum": [None, "SIGURG", "SIGWINCH", "SIGUSR1", "SIGUSR2", "SIGQUIT"]},
        "a signal name (SIGURG or SIGWINCH: ignored by processes that do not register it) or null",
        "SIGURG",
        "scripts/stacks.py sends it; each rank writes its stacks",
    ),
    Key(
        "diagnostics.straggler_every_s",
        {"type": "number", "minimum": 0},
        "a number of seconds, 0 or more",
        "60",
    ),
    Key("diagnostics.straggler_factor", {"type": "number", "exclusiveMinimum": 1}, "a number above 1", "2"),
    Key("dist.backend", {"enum": [None, "nccl", "gloo", "mpi"]}, "nccl, gloo, mpi or null", "gloo"),
    Key("dist.timeout_min", POSITIVE_NUMBER, "a positive finite number of minutes", "30"),
    Key(
        "dist.init_timeout_min",
        POSITIVE_NUMBER,
        "a positive finite number of minutes",
        "30",
        "the collective timeout until the first training step is done",
    ),
    Key(
        "dist.find_unused_parameters",
        {"type": "boolean"},
        "true or false",
        "true",
        "DDP: parameters may go unused in a step (manual optimization, GANs)",
    ),
    Key(
        "dist.static_graph",
        {"type": "boolean"},
        "true or false",
        "true",
        "DDP: the graph is the same every step",
    ),
    Key(
        "requeue.stop_grace_s",
        POSITIVE_NUMBER,
        "a positive finite number of seconds",
        "10",
        "a SIGTERM or Ctrl-C that no batch follows for this long ends the run anyway",
    ),
    Key(
        "checkpoints.trusted_targets",
        {"type": "array", "items": {"type": "string", "pattern": r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$"}},
        "a list of dotted class or function names",
        "[mypackage.models.Net]",
        "classes a checkpoint's stored config may name besides those of the project's configs",
    ),
    Key(
        "checkpoints.async_save",
        {"type": "boolean"},
        "true or false",
        "true",
        "write checkpoints while training goes on",
    ),
    Key(
        "dist.tensor_parallel",
        {"type": "integer", "minimum": 1},
        "a whole number, 1 or more",
        "2",
        "FSDP2: processes per tensor-parallel group",
    ),
    Key(
        "dist.tensor_parallel_plan",
        {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {
                        "colwise": {"type": "array", "items": {"type": "string"}},
                        "rowwise": {"type": "array", "items": {"type": "string"}},
                    },
                    "additionalProperties": False,
                },
            ]
        },
        "null or {colwise: [module patterns], rowwise: [module patterns]}",
        "{colwise: [blocks.*.q], rowwise: [blocks.*.proj]}",
        "FSDP2: how dist.tensor_parallel splits the network's layers",
    ),
    Key(
        "dist.fsdp.shard",
        {"anyOf": [{"const": "auto"}, {"type": "array", "items": {"type": "string"}}]},
        "auto or a list of module class names",
        "[Block]",
        "FSDP2: the modules sharded one by one",
    ),
    Key(
        "dist.fsdp.param_dtype",
        {"enum": [None, "bfloat16", "float16", "float32"]},
        "bfloat16, float16, float32 or null",
        "bfloat16",
        "FSDP2 mixed precision: compute dtype",
    ),
    Key(
        "dist.fsdp.reduce_dtype",
        {"enum": [None, "bfloat16", "float16", "float32"]},
        "bfloat16, float16, float32 or null",
        "float32",
        "FSDP2 mixed precision: gradient reduction dtype",
    ),
    Key(
        "dist.fsdp.activation_checkpointing",
        {"type": "boolean"},
        "true or false",
        "true",
        "FSDP2: recompute each sharded block's activations",
    ),
    Key(
        "dist.fsdp.cpu_offload",
        {"type": "boolean"},
        "true or false",
        "true",
        "FSDP2: parameters and optimizer states in host memory",
    ),
    Key(
        "predict.split",
        {"enum": ["test", "val", "train"]},
        "test, val or train",
        "val",
        "the split to predict",
    ),
    Key(
        "predict.batch_size", {"type": ["integer", "null"], "minimum": 1}, "a positive integer or null", "256"
    ),
    Key("predict.num_workers", _int(0), "a non-negative integer", "4"),
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
        _int(2),
        "an integer, 2 or more (traced on a batch of 1, the export would take only batches of 1)",
        "2",
        "the example batch the export is traced with; the exported model takes any batch size",
    ),
    Key("paths.data_dir", {"type": "string"}, "a directory", "/shared/datasets"),
    Key("paths.log_dir", {"type": "string"}, "a directory", "/shared/logs"),
)


def _type_ok(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":  # finite: an infinite timeout is a hang with extra steps, NaN compares as nothing
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "array": isinstance(value, (list, tuple)),
        "object": isinstance(value, dict),
    }[name]


def validate(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` satisfies `schema` (the JSON Schema keywords used in KEYS)."""
    if "anyOf" in schema:
        return any(validate(value, option) for option in schema["anyOf"])
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and not any(value == v and type(value) is type(v) for v in schema["enum"]):
        return False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(value, t) for t in types):
            return False
    numeric = _type_ok(value, "number")
    if numeric and "minimum" in schema and value < schema["minimum"]:
        return False
    if numeric and "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        return False
    if numeric and "maximum" in schema and value > schema["maximum"]:
        return False
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        return False
    if isinstance(value, (list, tuple)):
        if len(value) < schema.get("minItems", 0):
            return False
        if "items" in schema and not all(validate(v, schema["items"]) for v in value):
            return False
    return True


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
