"""Type and value checks on the composed config, before anything heavy runs.

Hydra rejects unknown keys itself; these rules catch a wrong type or value (`trainer.max_epochs=ten`,
`data.batch_size=0`) and missing optional packages, and say so in one sentence instead of a stack
trace from deep inside Lightning ten seconds later.
"""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpctrain.errors import UserError

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
    "transformer-engine",
)
# packages an optional logger needs, recognised in its _target_ (TensorBoardLogger, mlflow_logger, ...)
LOGGER_PACKAGES = ("tensorboard", "mlflow", "wandb")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _devices(value: Any) -> bool:
    if value == "auto" or _positive_int(value) or value == -1:
        return True
    if isinstance(value, str):
        return all(part.strip().isdigit() for part in value.split(",") if part.strip())
    return OmegaConf.is_list(value) and all(_int(v) for v in value)


def _signal(value: Any) -> bool:
    return isinstance(value, str) and value in signal.Signals.__members__


@dataclass(frozen=True)
class Rule:
    key: str
    expected: str
    ok: Callable[[Any], bool]
    example: str


RULES = (
    Rule("seed", "an integer", _int, "42"),
    Rule("trainer.max_epochs", "an integer (-1 for no limit)", _int, "10"),
    Rule("trainer.min_epochs", "an integer", _int, "1"),
    Rule("trainer.num_nodes", "a positive integer", _positive_int, "2"),
    Rule("trainer.devices", "a positive integer, a list of device ids, or auto", _devices, "2"),
    Rule(
        "trainer.precision", f"one of {', '.join(PRECISIONS)}", lambda v: str(v) in PRECISIONS, "bf16-mixed"
    ),
    Rule("trainer.log_every_n_steps", "a positive integer", _positive_int, "50"),
    Rule("data.batch_size", "a positive integer", _positive_int, "64"),
    Rule("data.num_workers", "a non-negative integer", lambda v: _int(v) and v >= 0, "4"),
    Rule("model.optimizer.lr", "a positive number", _positive_number, "0.001"),
    Rule("dist.timeout_min", "a positive number of minutes", _positive_number, "30"),
    Rule("requeue.signal", "a signal name", _signal, "SIGUSR1"),
    Rule("requeue.check_every_n_steps", "a positive integer", _positive_int, "1"),
)

_ABSENT = object()


def _value(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=True)
    except OmegaConfBaseException as err:
        message = str(err).splitlines()[0]
        raise UserError(f"{key} cannot be resolved ({message}); check the value you passed for it.") from err


def check_config(cfg: DictConfig) -> None:
    """Raise UserError for the first value that breaks a rule, or a logger whose package is missing."""
    for rule in RULES:
        value = _value(cfg, rule.key)
        if value is _ABSENT or value is None:
            continue
        if not rule.ok(value):
            raise UserError(
                f"{rule.key}={value!r} is not {rule.expected}; pass e.g. {rule.key}={rule.example}."
            )
    for name, entry in (cfg.get("logger") or {}).items():
        target = str((entry or {}).get("_target_", "")).lower()
        for package in LOGGER_PACKAGES:
            if package in target and importlib.util.find_spec(package) is None:
                raise UserError(
                    f"logger={name} needs the {package} package, which is not installed; "
                    f"pip install -e '.[{package}]' (or pass logger=csv)."
                )
