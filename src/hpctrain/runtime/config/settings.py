"""hpctrain's own settings, typed: one frozen dataclass per concept, built and checked once after the config
is composed (`Settings.of`), then handed to the code that uses them and read as attributes.

Each field carries, in its metadata, its JSON Schema fragment, what it takes in words, an example and a
description: the checks, the editor schema (`src/hpctrain/conf/schema/`, `scripts/dev/config_schema.py`)
and the reference page (`docs/reference/config.md`) come from these definitions (`schema.KEYS` lists
them with the keys of Lightning's Trainer, the data and the model, which are not hpctrain's to type).
A key that no dataclass names, in a section that is hpctrain's, is a typo: it is refused in one sentence
that names the key, the file that sets it, and the closest real key. A cluster preset
(`conf/cluster/<name>.yaml`) is such a section too, so a site's typo no longer falls back to a default.
No torch here.
"""

from __future__ import annotations

import difflib
import signal
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from hpctrain.runtime.config.compose import CONF_DIR, group_options
from hpctrain.runtime.config.validation import validate
from hpctrain.runtime.environment.variables import int_or_none
from hpctrain.runtime.errors import UserError

NOTIFY_EVENTS = ("completed", "failed", "nan", "hung", "budget", "sweep")  # notify's (tests/test_notify.py)
POSITIVE_NUMBER = {"type": "number", "exclusiveMinimum": 0}
STRINGS = {"type": "array", "items": {"type": "string"}}
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


def integer(minimum: int | None = None) -> dict[str, Any]:
    return {"type": "integer"} | ({"minimum": minimum} if minimum is not None else {})


def setting(default: Any, schema: dict[str, Any], expected: str, example: str, description: str = "") -> Any:
    """A field of a settings dataclass, with what the checks, the schema and the docs need to know of it."""
    meta = {"schema": schema, "expected": expected, "example": example, "description": description}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag(default: bool, example: str, description: str = "") -> Any:
    """A true-or-false setting."""
    return setting(default, {"type": "boolean"}, "true or false", example, description)


@dataclass(frozen=True)
class Requeue:
    enabled: bool = flag(True, "true")
    signal: str = setting(
        "SIGUSR1",
        {"enum": sorted(s.name for s in signal.Signals)},
        "a signal name such as SIGUSR1",
        "SIGUSR1",
        "must match #SBATCH --signal",
    )
    check_every_n_steps: int | str = setting(
        "auto",
        {"anyOf": [integer(1), {"const": "auto"}]},
        "a positive integer or auto",
        "auto",
        "how often ranks agree on signals; auto: about once a second",
    )
    max_attempts: int | None = setting(
        10,
        {"type": ["integer", "null"], "minimum": 1},
        "a positive integer or null (no cap)",
        "10",
        "attempt N of a SLURM job stops instead of requeueing again",
    )
    signal_lead_s: float = setting(
        90,
        POSITIVE_NUMBER,
        "a positive number of seconds",
        "90",
        "how long before the time limit the signal comes: the N of #SBATCH --signal=SIGUSR1@N",
    )
    stop_grace_s: float = setting(
        10,
        POSITIVE_NUMBER,
        "a positive finite number of seconds",
        "10",
        "a SIGTERM or Ctrl-C that no batch follows for this long ends the run anyway",
    )


@dataclass(frozen=True)
class Checkpoints:
    async_save: bool = flag(False, "true", "write checkpoints while training goes on")
    trainable_only: bool | str = setting(
        "auto",
        {"anyOf": [{"type": "boolean"}, {"const": "auto"}]},
        "auto, true or false",
        "true",
        "store the trainable parameters (and their optimizer state) only; the frozen part is rebuilt from its "
        "source; auto: when most parameters are frozen and the model reads them from files (pretrained_files)",
    )


@dataclass(frozen=True)
class Nan:
    action: str = setting(
        "stop", {"enum": ["stop", "off"]}, "stop or off", "off", "what a non-finite training loss does"
    )
    check_every_n_steps: int = setting(
        50, integer(1), "a positive integer", "100", "steps between looks at the loss"
    )


@dataclass(frozen=True)
class Notify:
    url_env: str = setting(
        "HPCTRAIN_NOTIFY_URL",
        {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
        "the name of an environment variable (the URL itself stays in the environment)",
        "HPCTRAIN_NOTIFY_URL",
        "the variable holding the webhook URL; notifications are on where it is set",
    )
    timeout_s: float = setting(
        5,
        POSITIVE_NUMBER,
        "a positive finite number of seconds",
        "5",
        "the longest a notification may delay the end of a process",
    )
    events: list[str] = setting(
        list(NOTIFY_EVENTS),
        {"type": "array", "items": {"enum": list(NOTIFY_EVENTS)}},
        f"a list of {', '.join(NOTIFY_EVENTS)}",
        "[failed,hung]",
        "the events posted to the webhook",
    )


@dataclass(frozen=True)
class Diagnostics:
    stacks_signal: str | None = setting(
        "SIGURG",
        {"enum": [None, "SIGURG", "SIGWINCH", "SIGUSR1", "SIGUSR2", "SIGQUIT"]},
        "a signal name (SIGURG or SIGWINCH: ignored by processes that do not register it) or null",
        "SIGURG",
        "scripts/stacks.py sends it; each rank writes its stacks",
    )
    straggler_every_s: float = setting(
        30, {"type": "number", "minimum": 0}, "a number of seconds, 0 or more", "60"
    )
    straggler_factor: float = setting(1.5, {"type": "number", "exclusiveMinimum": 1}, "a number above 1", "2")


DTYPES = [None, "bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class FSDP:
    shard: str | list[str] = setting(
        "auto",
        {"anyOf": [{"const": "auto"}, STRINGS]},
        "auto or a list of module class names",
        "[Block]",
        "FSDP2: the modules sharded one by one",
    )
    param_dtype: str | None = setting(
        None,
        {"enum": DTYPES},
        "bfloat16, float16, float32 or null",
        "bfloat16",
        "FSDP2 mixed precision: compute dtype",
    )
    reduce_dtype: str | None = setting(
        None,
        {"enum": DTYPES},
        "bfloat16, float16, float32 or null",
        "float32",
        "FSDP2 mixed precision: gradient reduction dtype",
    )
    activation_checkpointing: bool = flag(False, "true", "FSDP2: recompute each sharded block's activations")
    cpu_offload: bool = flag(False, "true", "FSDP2: parameters and optimizer states in host memory")
    sync_each_micro_batch: bool = flag(
        False, "true", "FSDP2 with accumulate_grad_batches: reduce every micro-batch's gradients"
    )
    replicate: int = setting(
        1,
        integer(1),
        "a whole number, 1 or more",
        "2",
        "FSDP2 as HSDP: copies of the model, each sharded over its own processes; ${trainer.num_nodes}: a node's",
    )


@dataclass(frozen=True)
class Dist:
    backend: str | None = setting(
        None, {"enum": [None, "nccl", "gloo", "mpi"]}, "nccl, gloo, mpi or null", "gloo"
    )
    timeout_min: float = setting(30, POSITIVE_NUMBER, "a positive finite number of minutes", "30")
    init_timeout_min: float | None = setting(
        None,
        {"anyOf": [POSITIVE_NUMBER, {"type": "null"}]},
        "a positive finite number of minutes",
        "30",
        "the collective timeout until the first training step is done",
    )
    find_unused_parameters: bool = flag(
        False, "true", "DDP: parameters may go unused in a step (manual optimization, GANs)"
    )
    static_graph: bool = flag(False, "true", "DDP: the graph is the same every step")
    tensor_parallel: int = setting(
        1,
        {"type": "integer", "minimum": 1},
        "a whole number, 1 or more",
        "2",
        "FSDP2: processes per tensor-parallel group",
    )
    tensor_parallel_plan: dict[str, list[str]] | None = setting(
        None,
        {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"colwise": STRINGS, "rowwise": STRINGS},
                    "additionalProperties": False,
                },
            ]
        },
        "null or {colwise: [module patterns], rowwise: [module patterns]}",
        "{colwise: [blocks.*.q], rowwise: [blocks.*.proj]}",
        "FSDP2: how dist.tensor_parallel splits the network's layers",
    )
    fsdp: FSDP = field(default_factory=FSDP)

    @property
    def startup_timeout_min(self) -> float:
        """The collective timeout until the first training step is done."""
        return self.init_timeout_min or self.timeout_min


@dataclass(frozen=True)
class InitFrom:
    path: str | None = setting(
        None,
        {"type": ["string", "null"]},
        "a checkpoint, a .pt/.pth state dict, a .safetensors file, or null",
        "logs/train/runs/<run>/checkpoints/last.ckpt",
        "start a new run from these weights",
    )
    strict: bool = flag(True, "false", "false: load what fits")
    prefix: str = setting(
        "", {"type": "string"}, "a string put in front of every key", "net.", "maps a bare network"
    )
    exclude: list[str] = setting(
        [],
        STRINGS,
        "a list of regular expressions (in brackets)",
        "['^net[.]fc[.]']",
        "keys left out of the weights loaded",
    )
    freeze: list[str] = setting(
        [],
        STRINGS,
        "a list of regular expressions (in brackets)",
        "['^net[.]features[.]']",
        "parameters not trained",
    )
    unfreeze_at_epoch: int | None = setting(
        None,
        {"type": ["integer", "null"], "minimum": 0},
        "a non-negative integer or null",
        "3",
        "the frozen parameters train too from this epoch on",
    )


@dataclass(frozen=True)
class Monitor:
    metric: str | None = setting(
        "val/acc", {"type": ["string", "null"]}, "a metric name the model logs", "val/acc"
    )
    mode: str = setting(
        "max", {"enum": ["min", "max"]}, "min or max", "max", "whether a larger monitored value is better"
    )


@dataclass(frozen=True)
class Extras:
    print_config: str | bool = setting(
        "summary",
        {"anyOf": [{"enum": ["summary", "full"]}, {"type": "boolean"}]},
        "summary, full or false",
        "full",
        "what a run prints of its config: a few lines, the whole tree (true: the same), or nothing",
    )
    ignore_warnings: bool = flag(False, "true", "silence Python warnings")
    float32_matmul_precision: str | None = setting(
        "high",
        {"enum": [None, "highest", "high", "medium"]},
        "highest, high, medium or null",
        "high",
        "TF32 matmuls on Ampere+ GPUs",
    )


@dataclass(frozen=True)
class Cluster:
    """A site's resources (conf/cluster/<name>.yaml), asked of Slurm by config/slurm_request.py (the defaults
    when no preset is chosen, the #SBATCH lines' too); the run uses `offline` and `scratch_dir`."""

    name: str = setting("local", {"type": "string"}, "the preset's name", "narval")
    partition: str | None = setting(None, {"type": ["string", "null"]}, "a partition name or null", "gpu")
    account: str | None = setting(None, {"type": ["string", "null"]}, "an account or null", "def-mypi")
    qos: str | None = setting(None, {"type": ["string", "null"]}, "a QOS or null", "normal")
    gpus_per_node: int = setting(8, integer(0), "a non-negative integer (0: CPU nodes)", "4")
    gpu_type: str | None = setting(
        None, {"type": ["string", "null"]}, "a GPU type of the GRES or null", "a100"
    )
    tasks_per_node: int = setting(1, integer(1), "a positive integer", "4", "one task per GPU on GPU nodes")
    cpus_per_task: int = setting(8, integer(1), "a positive integer", "8", "on GPU nodes: per GPU")
    mem_per_task_gb: float = setting(0, {"type": "number", "minimum": 0}, "a number of GB, 0: all", "64")
    time_min: int = setting(240, integer(1), "a positive number of minutes", "1440")
    offline: bool = flag(False, "true", "compute nodes without internet")
    scratch_dir: str | None = setting(
        None, {"type": ["string", "null"]}, "a directory or null", "$SLURM_TMPDIR"
    )
    setup: list[str] = setting([], STRINGS, "a list of shell lines", "[]")

    @classmethod
    def load(cls, path: Path) -> Cluster:
        """A preset file, checked (`scripts/submit.py --cluster NAME` reads it without composing)."""
        preset = OmegaConf.load(path)
        content = OmegaConf.to_container(preset, resolve=True)
        if not isinstance(content, dict):
            raise UserError(
                f"{path} is not a cluster preset (a mapping of its keys); see conf/cluster/ for the form."
            )
        return _built(cls, content, "cluster", lambda key: _shown(path))


@dataclass(frozen=True)
class Predict:
    """src/predict.py's (conf/predict.yaml): what is predicted, in what batches, into which file."""

    split: str = setting(
        "test", {"enum": ["test", "val", "train"]}, "test, val or train", "val", "the split to predict"
    )
    input: str | None = setting(
        None, {"type": ["string", "null"]}, "a folder of images, a .pt/.npy file, or null", "photos/"
    )
    output: str | None = setting(None, {"type": ["string", "null"]}, "a file path or null", "predictions.csv")
    batch_size: int | None = setting(
        None, {"type": ["integer", "null"], "minimum": 1}, "a positive integer or null", "256"
    )
    num_workers: int = setting(0, integer(0), "a non-negative integer", "4")


@dataclass(frozen=True)
class Eval:
    """src/eval.py's (conf/eval.yaml): the split a checkpoint is evaluated on."""

    split: str | None = setting(
        None,
        {"enum": [None, "test", "val"]},
        "test, val or null",
        "val",
        "null: test where the model has a test_step and the data a test split, else val",
    )


@dataclass(frozen=True)
class TrainerKeys:
    """The keys of Lightning's trainer group that hpctrain reads (the launch checks, the strategy, the CPU
    plan, the precision notes). The group's other keys are Lightning's: passed to the Trainer whole,
    neither read nor refused here (`lightnings`)."""

    lightnings = True  # a key not named here is Lightning's, not a typo

    num_nodes: int = setting(1, integer(1), "a positive integer", "2", "nodes (SLURM: --nodes)")
    devices: int | str | list[int] = setting(
        1,
        {
            "anyOf": [
                integer(1),
                {"const": -1},
                {"const": "auto"},
                {"type": "string", "pattern": r"^\s*\d+\s*(,\s*\d+\s*)*,?\s*$"},
                {"type": "array", "items": integer(0), "minItems": 1},
            ]
        },
        "a positive integer, -1, auto, or a list of device ids",
        "2",
        "processes per node: GPUs per node (SLURM: --ntasks-per-node)",
    )
    accelerator: str = setting(
        "auto", {"enum": list(ACCELERATORS)}, f"one of {', '.join(ACCELERATORS)}", "cpu"
    )
    precision: str | int = setting(
        "32-true",
        {"enum": [*PRECISIONS, 64, 32, 16]},
        f"one of {', '.join(PRECISIONS)}",
        "bf16-mixed",
        "32-true; bf16-mixed or 16-mixed on GPUs",
    )
    strategy: str | dict[str, Any] = setting(
        "auto",
        {"anyOf": [{"type": "string"}, {"type": "object"}]},
        "a strategy name (auto, ddp, fsdp) or a strategy's config",
        "ddp",
        "fsdp: FSDP2; ddp, or auto with more than one process: DDP",
    )
    sync_batchnorm: bool = flag(False, "true", "BatchNorm statistics over every process (DDP, FSDP2; GPUs)")

    @property
    def processes(self) -> int | None:
        """num_nodes x devices, or None where devices is not a count (auto, a list of device ids)."""
        devices = int_or_none(self.devices)
        return None if devices is None else self.num_nodes * devices


SECTIONS: dict[str, type] = {
    "requeue": Requeue,
    "checkpoints": Checkpoints,
    "nan": Nan,
    "notify": Notify,
    "diagnostics": Diagnostics,
    "dist": Dist,
    "init_from": InitFrom,
    "monitor": Monitor,
    "extras": Extras,
    "trainer": TrainerKeys,
}


@dataclass(frozen=True)
class Settings:
    """Everything of hpctrain's own in a composed config (see the module docstring)."""

    requeue: Requeue = field(default_factory=Requeue)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    nan: Nan = field(default_factory=Nan)
    notify: Notify = field(default_factory=Notify)
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    dist: Dist = field(default_factory=Dist)
    init_from: InitFrom = field(default_factory=InitFrom)
    monitor: Monitor | None = None  # None: the config has no monitor section (export)
    extras: Extras = field(default_factory=Extras)
    trainer: TrainerKeys = field(default_factory=TrainerKeys)
    cluster: Cluster | None = None  # None: no preset chosen (cluster=null)
    predict: Predict | None = None  # None: not src/predict.py's config
    eval: Eval | None = None  # None: not src/eval.py's config
    # the top-level keys (conf/train.yaml): the entry points' and the build's switches
    seed: int = setting(
        12345,
        {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},  # numpy's seeds are 32-bit
        "an integer from 0 to 4294967295",
        "42",
        "seeds torch, numpy, python and dataloader workers",
    )
    train: bool = flag(True, "false", "fit the model; false: validate it as built (or as ckpt_path left it)")
    test: bool = flag(True, "false", "test the best checkpoint after fit")
    ckpt_path: str | None = setting(
        None,
        {"type": ["string", "null"]},
        "a checkpoint file, last, or null",
        "last",
        "start from this checkpoint (last: the newest last.ckpt of this task's runs)",
    )
    snapshot: bool = flag(True, "false", "launcher jobs run from a code snapshot")
    skip_completed: bool = flag(False, "true", "a re-run sweep skips completed points")
    compile: bool = flag(False, "true", "torch.compile the model's networks")
    compile_backend: str = setting("inductor", {"type": "string"}, "a torch.compile backend", "inductor")
    channels_last: bool = flag(False, "true", "channels-last memory order for CNNs")
    num_threads: int | str | None = setting(
        "auto",
        {"anyOf": [integer(1), {"const": "auto"}, {"type": "null"}]},
        "a positive integer or auto",
        "4",
        "torch's intra-op threads per process; auto: the process's CPUs less its loader workers",
    )

    @classmethod
    def of(cls, cfg: DictConfig, where: Any = None) -> Settings:
        """The settings of a composed config, checked: an unknown key or a wrong value is one sentence
        naming the key and the file that set it (`where(key)`; the default names the config files
        Hydra composed). A section set to null, or a key left `???`, keeps its default."""
        content: dict[str, Any] = {}
        for name in (f.name for f in fields(cls)):
            if name not in cfg or OmegaConf.is_missing(cfg, name):
                continue
            node, section = cfg.get(name), _section(cls, name)
            if getattr(section, "lightnings", False) and OmegaConf.is_config(node):  # the keys read only
                node = {key: node[key] for key in (f.name for f in fields(section)) if key in node}
            if node is not None or section is None:
                content[name] = _plain(node)
        return _built(cls, content, "", where or Sources())


def _plain(node: Any) -> Any:
    """A config value as plain Python, resolved (a mapping's values too)."""
    if isinstance(node, dict):
        return {key: _plain(value) for key, value in node.items()}
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def unset(value: Any) -> bool:
    """Whether a path-like value means none: null, an empty string, or the word null (an environment
    variable or a quoted YAML value carries it as text)."""
    return value in (None, "", "null")


def _built(kind: type, content: Mapping[str, Any], prefix: str, where: Any) -> Any:
    known = {f.name: f for f in fields(kind)}
    values: dict[str, Any] = {}
    for key, value in content.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in known and getattr(kind, "lightnings", False):
            continue
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {prefix}.{close[0]}?" if close else f"; its keys are {', '.join(known)}"
            raise UserError(f"{dotted} is not a key of {prefix} (set in {where(dotted)}){hint}")
        nested = _section(kind, key)
        if nested is not None:
            if not isinstance(value, dict):
                raise UserError(
                    f"{dotted} is {value!r} in {where(dotted)}, but it is a section of keys: {dotted}.<key>=..."
                )
            values[key] = _built(nested, value, dotted, where)
            continue
        meta = known[key].metadata
        if not validate(value, meta["schema"]):
            shown = value if not isinstance(value, str) else f"'{value}'"
            raise UserError(
                f"{dotted}={shown} is not {meta['expected']} (set in {where(dotted)}); pass e.g. {dotted}={meta['example']}."
            )
        values[key] = value
    return kind(**values)


def _section(kind: type, name: str) -> type | None:
    """The settings dataclass a field holds (a section of keys), or None for a plain value."""
    if kind is Settings:
        return {**SECTIONS, "cluster": Cluster, "predict": Predict, "eval": Eval}.get(name)
    factory = next(f.default_factory for f in fields(kind) if f.name == name)
    return factory if factory is not MISSING and is_dataclass(factory) else None


def all_keys(kind: type = Settings, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(dotted key, its metadata) of every setting: what `schema.KEYS` and the editor schema are made from."""
    found: list[tuple[str, dict[str, Any]]] = []
    for entry in fields(kind):
        nested = _section(kind, entry.name)
        if nested is not None:
            found += all_keys(nested, f"{prefix}{entry.name}.")
        else:
            found.append((f"{prefix}{entry.name}", dict(entry.metadata)))
    return found


def _shown(path: Path) -> str:
    for base in (Path.cwd(), *Path.cwd().parents):
        try:
            return str(path.resolve().relative_to(base))
        except ValueError:
            continue
    return str(path)


class Sources:
    """Which file set a key of the composed config: the command line, the chosen option of a group (a
    cluster preset), or, of the files composed into the whole config, the last one that holds it (local,
    debug, hparams_search, experiment, then the primary config)."""

    GLOBAL_GROUPS = ("local", "debug", "hparams_search", "experiment")

    def __init__(self, hydra_cfg: Any = None, overrides: list[str] | None = None) -> None:
        self.hydra_cfg = hydra_cfg
        self.overrides = list(overrides or [])

    def __call__(self, key: str) -> str:
        if any(o.lstrip("+~").split("=", 1)[0] in (key, key.split(".", 1)[0]) for o in self.overrides):
            return "the command line"
        if self.hydra_cfg is None:
            return "the composed config"

        choices = OmegaConf.to_container(self.hydra_cfg.runtime.choices) or {}
        section = key.split(".", 1)[0]
        if section == "cluster" and choices.get("cluster"):
            found = group_options("cluster").get(str(choices["cluster"]))
            return _shown(found) if found else "conf/cluster/"
        candidates = [
            group_options(group).get(str(choices.get(group)))
            for group in self.GLOBAL_GROUPS
            if not unset(choices.get(group))
        ]
        candidates.append(CONF_DIR / f"{self.hydra_cfg.job.config_name}.yaml")
        for path in candidates:
            if path is not None and _holds(path, key):
                return _shown(path)
        return _shown(candidates[-1])


def _holds(path: Path, key: str) -> bool:
    try:
        node: Any = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
