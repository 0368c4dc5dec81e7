"""An exporter that fails, as one sentence: the format, torch's reason (its first meaningful line) and
the line of the model's code where the trace stopped. What the exporter writes to stderr meanwhile is
kept off the terminal and shown only when it fails."""

from __future__ import annotations

import io
import logging
import re
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

from hpctrain.runtime.errors import UserError

# the ONNX passes log a progress line per pass: kept off the terminal while an exporter runs
_QUIETED = ("onnxscript", "onnx_ir")


@contextmanager
def reported(format_name: str) -> Iterator[None]:
    """Around an exporter's call: its exception as one sentence. What it writes to stderr meanwhile is
    held back, and passed on only if it succeeds: a failed trace prints whole graphs before it raises
    (torch.export does, unconditionally), and the sentence says what matters in them."""
    loggers = {logging.getLogger(name): logging.getLogger(name).level for name in _QUIETED}
    for logger in loggers:
        logger.setLevel(max(logging.WARNING, logger.getEffectiveLevel()))
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
    except UserError:
        raise
    except Exception as err:
        raise UserError(
            f"export.format={format_name} cannot export this model: {reason(err)}; make its forward "
            "traceable by torch.export (no Python branch on a tensor's values, no .item() or .numpy(), "
            "no fixed batch size), or export the weights alone with export.format=safetensors."
        ) from err
    finally:
        for logger, level in loggers.items():
            logger.setLevel(level)
    sys.stderr.write(held.getvalue())


# torch's pointers to more logs, cut from its messages: the sentence keeps what went wrong
_HINT = re.compile(r"\s*(For more information|For extended logs|consider using|Caused by)\b.*", re.I)
_LIBRARIES = (
    "torch",
    "pytorch_lightning",
    "lightning_fabric",
    "torchmetrics",
    "onnx",
    "onnxscript",
    "onnxruntime",
)


def reason(err: BaseException) -> str:
    """The exception's reason as one clause: the first meaningful line of its innermost cause (torch's
    exporters wrap the real reason), and the line of the model's code the trace stopped at, if any."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [_HINT.sub("", line).strip(" -") for line in str(root).splitlines()]
    line = next((line for line in lines if len(line.split()) >= 4), lines[0] if lines else "")
    sentence = re.split(r"(?<=[.!?])\s", line)[0].rstrip(".; ") or type(root).__name__
    if len(sentence) > 200:
        sentence = sentence[:197].rsplit(" ", 1)[0] + " ..."
    place = _model_code_line(err)
    return f"{sentence}, at {place}" if place else sentence


def _model_code_line(err: BaseException) -> str | None:
    """`file:line (code)` of the innermost frame outside the libraries, the standard library and the
    template's machinery: the line of the model (yours or the template's) where the trace stopped."""
    found = None
    chain: BaseException | None = err
    while chain is not None:
        for frame in traceback.extract_tb(chain.__traceback__):
            path = Path(frame.filename)
            if path.is_file() and not _in_a_library(path):
                found = f"{_shown(path)}:{frame.lineno} ({(frame.line or '').strip()})"
        chain = chain.__cause__
    return found


def _in_a_library(path: Path) -> bool:
    paths = sysconfig.get_paths()
    folders = [Path(__file__).parents[1]]  # hpctrain.runtime
    folders += [Path(m.__file__).parent for name in _LIBRARIES if (m := sys.modules.get(name)) and m.__file__]
    installed = path.is_relative_to(paths["purelib"]) or path.is_relative_to(paths["platlib"])
    return any(path.is_relative_to(f) for f in folders) or (
        path.is_relative_to(paths["stdlib"]) and not installed
    )


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
