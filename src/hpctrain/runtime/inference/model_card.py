"""model_card.md beside an export (inside an exported folder): what the model is, what it takes and
gives, how well it did, and how to load it. Everything comes from what exists: the checkpoint, the config
stored in it, and the records of the run that trained it (its run dir is usually the checkpoint's folder's
parent: run.yaml, outcome.yaml, metrics.csv, see `records`); a record that is missing is said, not guessed.

Those are files someone else may have written: what they give is shown as data, one line of text each
(`_text`: no line break, no backtick, so nothing they hold can end a comment or open a code block), a
number only where a number is expected, a commit only if it is one; and the code a card shows builds from
the reader's project, never from them (`export.FORMATS`' card functions).
"""

from __future__ import annotations

import csv
import io
import math
import re
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hpctrain.runtime import confined
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.inference.export import (
    ATOL,
    RTOL,
    Exported,
    describe,
    describe_tensor,
    file_size,
    tensors,
)
from hpctrain.runtime.storage import records
from hpctrain.runtime.storage.checkpoints import CHECKPOINT_DIR

if TYPE_CHECKING:
    from hpctrain.runtime.inference.loaded import Predictor

CARD = "model_card.md"


def write(exported: Exported, predictor: Predictor, checkpoint: Path) -> Path:
    """Write model_card.md inside the export where it is a folder (peft, hf_merged), else beside its file;
    return its path."""
    card = (exported.path if exported.path.is_dir() else exported.path.parent) / CARD
    card.write_text(text(exported, predictor, checkpoint))
    return card


def text(exported: Exported, predictor: Predictor, checkpoint: Path) -> str:
    config = predictor.config
    model_target = (config.get("model") or {}).get("_target_", type(predictor.model).__name__)
    data_target = (config.get("data") or {}).get("_target_", "data not recorded")
    run_dir = checkpoint.resolve().parent.parent if checkpoint.parent.name == CHECKPOINT_DIR else None
    name, size, today = exported.path.name, file_size(exported.path), time.strftime("%Y-%m-%d")
    versions = _versions(exported)
    return "\n".join(
        [
            f"# {_short(model_target)} on {_short(data_target)}",
            "",
            f"Exported as **{exported.format.name}** to `{name}` ({size}) on {today} with {versions}, "
            f"from `{checkpoint}`{_position(checkpoint)}.",
            "",
            "## Input and output",
            "",
            *_input_and_output(exported, predictor),
            "",
            f"## Load it ({'with the project that trained it' if exported.format.name == 'safetensors' else 'no template code'})",
            "",
            "```python",
            *exported.format.card(exported, predictor),
            "```",
            "",
            "## Metrics",
            "",
            *_metrics(run_dir),
            "",
            "## Data",
            "",
            f"`{_text(data_target)}`: {_data_summary(config.get('data') or {})} (all of it under Config below).",
            "",
            "## Code",
            "",
            *_code(run_dir),
            "",
            "## Config (model and data, as stored in the checkpoint)",
            "",
            "```yaml",
            yaml.safe_dump(_described(config), sort_keys=False, width=1 << 16).rstrip(),
            "```",
            "",
        ]
    )


def _text(value: Any, limit: int = 200) -> str:
    """A value from a file, as one line of text for the card (see the module docstring)."""
    return " ".join(str(value).replace("`", "'").split())[:limit]


def _number(value: Any) -> float | None:
    """A finite number from a file, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _described(node: Any) -> Any:
    """A stored config for the card's Config section: every string made `_text`."""
    if isinstance(node, dict):
        return {_text(key): _described(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [_described(value) for value in node]
    return _text(node, 400) if isinstance(node, str) else node


def _short(target: Any) -> str:
    return _text(str(target).rsplit(".", 1)[-1], 80)


def _versions(exported: Exported) -> str:
    found = []
    for package in ("torch", *exported.format.packages):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def _position(checkpoint: Path) -> str:
    """`(epoch 3, step 120)`, from the checkpoint itself, when it records them."""
    from hpctrain.runtime.storage.checkpoints import reading

    content = reading.read(checkpoint, weights=False)
    epoch, step = content.get("epoch"), content.get("global_step")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (epoch, step)):
        return ""
    return f" (saved at epoch {epoch}, step {step})"


def _input_and_output(exported: Exported, predictor: Predictor) -> list[str]:
    outputs = tensors(exported.outputs)
    shown = ", ".join(describe_tensor(t) for t in outputs)
    classes = (predictor.config.get("data") or {}).get("num_classes")
    per_class = len(outputs) == 1 and classes and outputs[0].dim() == 2 and outputs[0].shape[1] == classes
    meaning = (
        f": one score per class (data.num_classes={classes}); the argmax is the predicted class"
        if per_class
        else ": what the model's forward returns"
    )
    checked = (
        f"- Checked at export: loaded back as below and run on a batch of {len(exported.inputs)} (it was "
        f"traced on {exported.traced_rows}), it gives the checkpoint model's outputs within "
        f"rtol={RTOL:.0e}, atol={ATOL:.0e} (largest difference {exported.difference:.1e})."
    )
    inputs = describe_tensor(exported.inputs)
    pixels = " (raw pixel values, 0-255)" if inputs.startswith("uint8") else ""
    if exported.format.name == "safetensors":
        return [
            "- The file holds the LightningModule's weights, and in its metadata a description: the model and "
            "data config (`config`, JSON), the input format (`input`) and the preprocessing (`preprocessing`); "
            "the model itself is built by the project's configs, as below.",
            f"- Input: {inputs}, any batch size N{pixels}; preprocessing, not in the file (apply it "
            f"yourself, as below): {describe(predictor.preprocess)}.",
            f"- Output: {shown}{meaning}.",
            checked,
        ]
    return [
        f"- Input: {inputs}, any batch size N{pixels}; preprocessing, inside the exported model: "
        f"{describe(predictor.preprocess)}.",
        f"- Output: {shown}{meaning}.",
        checked,
    ]


def _metrics(run_dir: Path | None) -> list[str]:
    """The training run's monitored best (outcome.yaml) and last logged value of each metric (metrics.csv)."""
    if run_dir is None:
        return ["Not found: the checkpoint is not in a run dir's checkpoints/ folder."]
    lines = []
    outcome = records.read_outcome(run_dir)
    value = _number(outcome.get("value"))
    if outcome.get("metric") and value is not None:
        status = _text(outcome.get("status", "status unknown"), 40)
        lines += [f"Monitored: best {_text(outcome['metric'], 80)} {value:.4g} (run {status}).", ""]
    last = _last_values(run_dir / "metrics.csv")
    if last:
        lines += ["| metric | last logged value |", "| --- | ---: |"]
        lines += [f"| {_text(name, 80).replace('|', '/')} | {value:.4g} |" for name, value in last.items()]
        lines += ["", "(the checkpoint may be of an earlier epoch than the last values)"]
    if not lines:
        return [f"None recorded: {run_dir} has no outcome.yaml or metrics.csv."]
    return [*lines, "", f"From the training run {run_dir}."]


def _last_values(metrics_csv: Path) -> dict[str, float]:
    """The last value of each metric column (not epoch, step or learning rates)."""
    if not metrics_csv.is_file():
        return {}
    last: dict[str, float] = {}
    text = confined.read_text(metrics_csv, "table", folder=metrics_csv.parent)
    for row in csv.DictReader(io.StringIO(text, newline="")):
        for key, value in row.items():
            if key and value and key not in ("epoch", "step") and not key.startswith("lr-"):
                try:
                    number = float(value)
                except ValueError:
                    continue
                if math.isfinite(number):
                    last[key] = number
    return dict(sorted(last.items()))


def _data_summary(data: dict[str, Any]) -> str:
    keys = ("num_classes", "image_shape", "mean", "std", "batch_size")
    shown = [f"{key}={_text(data[key], 80)}" for key in keys if data.get(key) is not None]
    return ", ".join(shown) or "no sizes recorded"


_COMMIT = re.compile(r"[0-9a-f]{7,64}")


def _code(run_dir: Path | None) -> list[str]:
    """The training run's git commit, from its run.yaml (a commit's hash, or nothing). Its command is
    not shown: a card says how to load the model in the reader's project, not what to type from a file."""
    try:
        record: dict[str, Any] = records.read_run_record(run_dir) if run_dir is not None else {}
    except UserError:
        record = {}
    git = record.get("git") if isinstance(record.get("git"), dict) else {}
    commit = git.get("commit")
    if not (isinstance(commit, str) and _COMMIT.fullmatch(commit)):
        return ["Git commit: not recorded (no run.yaml with a commit beside the checkpoint)."]
    dirty = " (with uncommitted changes)" if git.get("dirty") is True else ""
    return [f"Git commit: `{commit}`{dirty}."]
