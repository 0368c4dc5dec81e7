"""Export a checkpoint's model so that it runs without this template (src/export.py).

    export.format  file               holds                               loads with
    torch_export   model.pt2          the traced program (torch.export)   torch.export.load(path).module()
    onnx           model.onnx         that program as an ONNX graph       onnxruntime.InferenceSession(path)
    safetensors    model.safetensors  the LightningModule's weights;      hpctrain.load(path) in the project
                                      the options and values of its       that trained it: its configs build
                                      config (JSON, a proposal)           the model the file proposes
    peft           adapter/           a PEFT model's adapters, tokenizer  peft's PeftModel.from_pretrained
    hf_merged      merged/            the adapters merged into the base   transformers' from_pretrained alone
                                      (the last two: hpctrain.runtime.inference.hf_formats, the llm extra)

What is exported is `hpctrain.load(ckpt)`'s Predictor: the datamodule's preprocessing in front of the
model, so the two graphs take the data's raw inputs (uint8 images for the template's image data) and
normalise them inside. It is traced once, by torch.export (non-strict), on `export.batch_size` samples
with the batch dimension dynamic (torch.export.Dim); the ONNX graph is translated from that same program,
so the two formats succeed or fail together. Before an export counts as done, it is loaded back as a user
would load it and run on one sample more than it was traced with, and its outputs are compared with the
checkpoint's model. A model the exporter cannot trace is one sentence: the format, torch's reason and
the line of the model's code where the trace stopped.

torch is imported inside the functions, so a mistake in the command is one sentence before it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.inference import hf_formats
from hpctrain.runtime.inference.describe import describe, describe_tensor, file_size, input_name, tensors
from hpctrain.runtime.inference.exporter_errors import reason, reported
from hpctrain.runtime.namespaces import is_overridden

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import Tensor

    from hpctrain.runtime.inference.loaded import Predictor

log = logging.getLogger("hpctrain")

# how close the export's outputs must be to the checkpoint model's (tests/test_export.py asks the same)
RTOL, ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class Format:
    """One export format, whole: its file, what it needs installed, how it is written, how it is run back
    (the check), and how its model card says to load it. FORMATS, at the end of this module, is the one
    registry; the config schema lists the same names (`schema.EXPORT_FORMATS`, tests/test_export.py)."""

    name: str
    suffix: str
    packages: tuple[str, ...]  # beyond torch: what pyproject.toml's `export` extra installs for it
    write: Callable[[Any, Any, Path], None]  # (predictor, example inputs, path)
    run: Callable[[Path, Any, Any], Any]  # (path, inputs, predictor) -> outputs
    card: Callable[[Any, Any], list[str]]  # (exported, predictor) -> the card's Python lines
    extra: str = "export"  # the extra of pyproject.toml that installs `packages`
    stem: str = "model"  # the default name in the run dir: <stem><suffix> (a folder where suffix is "")


@dataclass
class Exported:
    """An export, written and checked: what src/export.py reports and the model card describes."""

    path: Path
    format: Format
    seconds: float  # to trace and write it
    traced_rows: int  # the batch size it was traced with
    inputs: Tensor  # the batch it was checked on: one sample more
    outputs: Any  # the checkpoint model's outputs on them
    difference: float  # the largest absolute difference of the export's outputs from those


# ------------------------------------------------------------------------------- before torch


def check_installed(name: str) -> Format:
    """The format (the schema allows only these names), once the packages it needs are found."""
    chosen = FORMATS[name]
    missing = [package for package in chosen.packages if importlib.util.find_spec(package) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise UserError(
            f"export.format={name} needs {', '.join(missing)}, which {verb} not installed; "
            f"pip install -e '.[{chosen.extra}]' (or make install)."
        )
    return chosen


def output_path(chosen: Format, output: str | None, run_dir: Path) -> Path:
    """export.output, or <run dir>/model<suffix>; a suffix of another format is refused (a likely slip)."""
    if not output:
        return run_dir / f"{chosen.stem}{chosen.suffix}"
    path = Path(output).expanduser()
    if chosen.suffix and path.suffix != chosen.suffix:
        raise UserError(
            f"export.output={output} does not end in {chosen.suffix}, the suffix of "
            f"export.format={chosen.name}; name the file <name>{chosen.suffix}, or pass the export.format "
            "its suffix stands for."
        )
    return path


# ------------------------------------------------------------------------------- what it takes


def sample_inputs(predictor: Predictor, cfg: DictConfig, rows: int) -> Tensor:
    """`rows` inputs as the exported model takes them: uint8 images of the data's shape when the
    datamodule has a preprocessing (the template's image data: random pixels, fixed seed, no data read),
    else the inputs of the first batch of the data itself (a datamodule of your own), repeated as needed."""
    import torch
    from torch import nn

    if predictor.image_shape and not isinstance(predictor.preprocess, nn.Identity):
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (rows, *predictor.image_shape), dtype=torch.uint8, generator=generator)
    inputs = _first_batch_inputs(cfg)
    return inputs.repeat(-(-rows // len(inputs)), *[1] * (inputs.dim() - 1))[:rows]


def _first_batch_inputs(cfg: DictConfig) -> Tensor:
    """The inputs of the first batch of the job's data (its test split, else validation, else train)."""
    from torch import Tensor

    from hpctrain.runtime.run import build

    with build.namespace_of_run(cfg):
        data = build.instantiated(cfg.data, "data", num_workers=0)  # one batch, in this process
    build.check_data_available(data)
    data.prepare_data()
    splits = (("test", "test_dataloader"), ("validate", "val_dataloader"), ("fit", "train_dataloader"))
    stage, loader = next(s for s in splits if is_overridden(s[1], data) or s[0] == "fit")
    data.setup(stage)
    batch = next(iter(getattr(data, loader)()))
    inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
    if isinstance(inputs, dict) and "input_ids" in inputs:  # token batches: the model takes the token ids
        inputs = inputs["input_ids"]
    if not isinstance(inputs, Tensor):
        raise UserError(
            f"{type(data).__name__}'s batches hold {type(inputs).__name__} inputs, not a tensor; export "
            "traces a model that takes one tensor (the first item of a batch): export the weights alone "
            "with export.format=safetensors."
        )
    return inputs


# ------------------------------------------------------------------------------- writing, checking


def write(predictor: Predictor, chosen: Format, path: Path, inputs: Tensor, traced_rows: int) -> Exported:
    """Trace on `inputs[:traced_rows]` and write `path`, then load it back and check it on all of `inputs`."""
    import torch

    log.info(
        "exporting as %s: input %s; preprocessing: %s",
        chosen.name,
        describe_tensor(inputs),
        describe(predictor.preprocess),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    chosen.write(predictor, inputs[:traced_rows], path)
    seconds = time.perf_counter() - started
    with torch.no_grad():
        outputs = predictor(inputs)
        difference = _check(path, chosen, predictor, inputs, outputs)
    return Exported(path, chosen, seconds, traced_rows, inputs, outputs, difference)


def _traced(predictor: Predictor, example: Tensor, name: str) -> Any:
    """torch.export's program of the predictor, its batch dimension dynamic."""
    import torch

    batch = torch.export.Dim("batch", min=1)
    with reported(name):
        return torch.export.export(predictor, (example,), dynamic_shapes=({0: batch},), strict=False)


def _write_torch_export(predictor: Predictor, example: Tensor, path: Path) -> None:
    import torch

    torch.export.save(_traced(predictor, example, "torch_export"), path)


def _write_onnx(predictor: Predictor, example: Tensor, path: Path) -> None:
    import torch

    program = _traced(predictor, example, "onnx")
    single = isinstance(predictor(example), torch.Tensor)
    with reported("onnx"):
        onnx_program = torch.onnx.export(
            program,
            (example,),
            dynamo=True,
            verbose=False,
            input_names=[input_name(example)],
            output_names=["output"] if single else None,
            dynamic_shapes=({0: "batch"},),  # the program's batch dimension, under this name
        )
    onnx_program.save(str(path))


def _write_safetensors(predictor: Predictor, example: Tensor, path: Path) -> None:
    from safetensors.torch import save_model

    save_model(predictor.model, str(path), metadata=safetensors_metadata(predictor, example))


def safetensors_metadata(predictor: Predictor, example: Tensor) -> dict[str, str]:
    """What a safetensors file holds beside the weights (strings only): the model and data config as
    JSON, and what goes in front of the model."""
    return {
        "format": "pt",
        "config": json.dumps(predictor.config),
        "input": describe_tensor(example),
        "preprocessing": describe(predictor.preprocess),
    }


def _run_torch_export(path: Path, inputs: Tensor, predictor: Predictor) -> Any:
    import torch

    return torch.export.load(path).module()(inputs)


def _run_onnx(path: Path, inputs: Tensor, predictor: Predictor) -> Any:
    import onnxruntime
    import torch

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {session.get_inputs()[0].name: inputs.numpy()})
    return [torch.from_numpy(output) for output in outputs]


def _run_safetensors(path: Path, inputs: Tensor, predictor: Predictor) -> Any:
    """As the model card says: `hpctrain.load` of the file in the project that trained it (the file proposes
    its options and values, the project's configs build the model; the preprocessing goes in front)."""
    from hpctrain.runtime.inference import loaded

    return loaded.load(path, predictor.overrides)(inputs)


def _check(path: Path, chosen: Format, predictor: Predictor, inputs: Tensor, outputs: Any) -> float:
    """The export, loaded back, on a batch size it was not traced with: the largest difference of its
    outputs from the checkpoint model's (refused beyond RTOL and ATOL)."""
    import torch

    rows = len(inputs)
    where = f"export.format={chosen.name} wrote {path}, but loaded back and run on a batch of {rows}"
    try:
        got = tensors(chosen.run(path, inputs, predictor))
    except Exception as err:
        raise UserError(
            f"{where} it fails ({reason(err)}); if the forward fixes the batch size (a view or reshape "
            "with a number), make that -1, or export the weights alone with export.format=safetensors."
        ) from err
    want = tensors(outputs)
    shapes = [tuple(t.shape) for t in got], [tuple(t.shape) for t in want]
    if shapes[0] != shapes[1]:
        raise UserError(
            f"{where} it gives outputs of shapes {shapes[0]}, not the checkpoint model's {shapes[1]}; if the "
            "forward fixes a size, make it follow the input, or export the weights alone with "
            "export.format=safetensors."
        )
    pairs = list(zip(got, want, strict=True))  # the same number of tensors: their shapes were compared
    difference = max(((g.double() - w.double()).abs().max().item() for g, w in pairs), default=0.0)
    if not all(torch.allclose(g.to(w.dtype), w, rtol=RTOL, atol=ATOL) for g, w in pairs):
        raise UserError(
            f"{where} its outputs differ from the checkpoint model's by up to {difference:.3g} (beyond "
            f"rtol={RTOL}, atol={ATOL}); do not rely on it (a forward that draws random numbers in eval mode "
            "differs on every call)."
        )
    return difference


def report(exported: Exported, card: Path, run_dir: Path) -> None:
    log.info("wrote %s (%s) in %.1f s", exported.path, file_size(exported.path), exported.seconds)
    log.info(
        "checked: loaded back and run on a batch of %d (traced on %d), it gives the checkpoint model's "
        "outputs (largest difference %.1e)",
        len(exported.inputs),
        exported.traced_rows,
        exported.difference,
    )
    log.info("model card: %s", card)
    log.info("run dir: %s", run_dir)


# ------------------------------------------------------------------------------- how a model card loads it


def _torch_export_card(exported: Exported, predictor: Predictor) -> list[str]:
    return [
        "import torch",
        "",
        f'model = torch.export.load("{exported.path.name}").module()',
        f"outputs = model(inputs)  # inputs: a torch tensor, {describe_tensor(exported.inputs)}",
    ]


def _onnx_card(exported: Exported, predictor: Predictor) -> list[str]:
    return [
        "import onnxruntime",
        "",
        f'session = onnxruntime.InferenceSession("{exported.path.name}")',
        f'outputs = session.run(None, {{"{input_name(exported.inputs)}": inputs}})'
        f"  # inputs: a numpy array, {describe_tensor(exported.inputs)}",
    ]


def _safetensors_card(exported: Exported, predictor: Predictor) -> list[str]:
    """The model built in the recipient's project: the file proposes its config's options and values, the
    project's own configs build the model (`hpctrain.runtime.config.proposals`); nothing in the file names
    code or a place."""
    name = json.dumps(exported.path.name)  # a double-quoted Python string, as the other cards write it
    chosen = [o for o in predictor.overrides if not o.lstrip("+~").startswith(("paths.", "seed="))]
    given = f", overrides={json.dumps(chosen)}" if chosen else ""  # what chose its classes and configs
    return [
        "# In the project that trained it (its code and conf/), with its environment: the file proposes the",
        "# options and values of its config, and your project's configs build the model from them.",
        "import torch",
        "",
        "import hpctrain",
        "",
        f"model = hpctrain.load({name}{given})  # its preprocessing in front, in eval mode",
        "with torch.no_grad():",
        f"    outputs = model({input_name(exported.inputs)})  # {input_name(exported.inputs)}: "
        f"{describe_tensor(exported.inputs)}",
    ]


FORMATS = {
    f.name: f
    for f in (
        Format("torch_export", ".pt2", (), _write_torch_export, _run_torch_export, _torch_export_card),
        Format(  # torch's exporter imports onnxscript
            "onnx", ".onnx", ("onnx", "onnxscript", "onnxruntime"), _write_onnx, _run_onnx, _onnx_card
        ),
        Format(
            "safetensors",
            ".safetensors",
            ("safetensors",),
            _write_safetensors,
            _run_safetensors,
            _safetensors_card,
        ),
        Format(
            "peft",
            "",
            ("transformers", "peft"),
            hf_formats.write_peft,
            hf_formats.run_peft,
            hf_formats.peft_card,
            extra="llm",
            stem="adapter",
        ),
        Format(
            "hf_merged",
            "",
            ("transformers", "peft"),
            hf_formats.write_merged,
            hf_formats.run_merged,
            hf_formats.merged_card,
            extra="llm",
            stem="merged",
        ),
    )
}
