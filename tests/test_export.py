"""`python src/export.py` as a user runs it: real processes, and every artifact loaded back as its model
card says (torch.export.load, onnxruntime, and for safetensors the card's own code: the model built by
the project's configs, never from the file's metadata) in a process where the template's run and
inference code cannot be imported, on a batch of another size than the export was traced with, compared
with `hpctrain.load(ckpt)`'s outputs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import hpctrain
from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.config.schema import EXPORT_FORMATS
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.inference import export, exporter_errors
from hpctrain.runtime.storage.checkpoints.reading import CONFIG_KEY
from tests.differential.cases import user_code, user_overrides
from tests.helpers import PYTHON, ROOT, assert_ok, local_env, require_modules, run_dirs, run_entry, train

SUFFIX = {"torch_export": ".pt2", "onnx": ".onnx", "safetensors": ".safetensors", "peft": "", "hf_merged": ""}
# the formats of any model; peft and hf_merged (folders, a PEFT model's) are tested in tests/test_llm.py
ANY_MODEL = ("torch_export", "onnx", "safetensors")
TRACED, CHECKED = 2, 5  # export.batch_size (the default), and the batch the tests run the artifact on

# Loads an artifact as its model card says, in a fresh process where what it must not need cannot be
# imported: the template's code for the two graphs (ONNX not even torch); a safetensors file holds weights
# and a proposal of its config only, so the project that trained it builds the model (hpctrain.load).
LOAD_WITHOUT_THE_TEMPLATE = r"""
import json, sys

fmt, artifact, inputs_file, outputs_file, card_file = sys.argv[1:]
from pathlib import Path
blocked = {
    "torch_export": ["hpctrain", "pytorch_lightning", "lightning"],
    "onnx": ["torch", "hpctrain", "pytorch_lightning", "lightning"],
    "safetensors": [],
}[fmt]
for name in blocked:
    sys.modules[name] = None  # importing it fails from here on

import numpy as np

inputs = np.load(inputs_file)
if fmt == "onnx":
    import onnxruntime

    session = onnxruntime.InferenceSession(artifact)
    outputs = session.run(None, {session.get_inputs()[0].name: inputs})[0]
elif fmt == "torch_export":
    import torch

    outputs = torch.export.load(artifact).module()(torch.from_numpy(inputs)).detach().numpy()
else:  # the model card's own code, run in the project that trained the model (the working directory)
    import re

    import torch

    card = open(card_file).read()
    code = re.search(r"```python\n(.*?)```", card, flags=re.DOTALL).group(1)
    code = code.replace(f'"{Path(artifact).name}"', repr(artifact))  # the card names the file beside it
    images = torch.from_numpy(inputs)
    scope = {"images": images}
    exec(code, scope)
    outputs = scope["outputs"].numpy()
np.save(outputs_file, outputs)
"""


def run_export(
    log_dir: Path, checkpoint: Path, *overrides: str, **kwargs
) -> subprocess.CompletedProcess[str]:
    return run_entry(
        "export.py",
        f"paths.log_dir={log_dir}",
        "extras.print_config=false",
        f"ckpt_path={checkpoint}",
        *overrides,
        **kwargs,
    )


def outputs_without_the_template(
    fmt: str, artifact: Path, inputs: torch.Tensor, tmp_path: Path
) -> torch.Tensor:
    inputs_file, outputs_file = tmp_path / "inputs.npy", tmp_path / "outputs.npy"
    np.save(inputs_file, inputs.numpy())
    env = {**local_env(), "PYTHONPATH": str(ROOT / "src")}  # the model's own classes, for safetensors
    card = artifact.parent / "model_card.md"
    result = subprocess.run(
        [
            PYTHON,
            "-c",
            LOAD_WITHOUT_THE_TEMPLATE,
            fmt,
            str(artifact),
            str(inputs_file),
            str(outputs_file),
            str(card),
        ],
        cwd=ROOT,  # the project that trained it: the safetensors card builds the model from its configs
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert_ok(result)
    return torch.from_numpy(np.load(outputs_file))


def assert_same_predictions(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))


@pytest.fixture(scope="session")
def quickstart_checkpoint(quickstart_run: Path) -> Path:
    """The quickstart's checkpoint (the classic CNN on the bundled digits), trained once per session."""
    return quickstart_run / "checkpoints" / "last.ckpt"


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ANY_MODEL)
def test_an_export_runs_without_the_template_at_another_batch_size(
    fmt: str, quickstart_checkpoint: Path, tmp_path
):
    assert_ok(run_export(tmp_path / "logs", quickstart_checkpoint, f"export.format={fmt}"))
    (run,) = run_dirs(tmp_path / "logs", task="export")
    artifact = run / f"model{SUFFIX[fmt]}"

    images = torch.randint(
        0, 256, (CHECKED, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        want = hpctrain.load(quickstart_checkpoint)(images)
    assert_same_predictions(outputs_without_the_template(fmt, artifact, images, tmp_path), want)

    card = (run / "model_card.md").read_text()
    assert f"**{fmt}**" in card and "uint8 (N, 1, 28, 28)" in card and "one score per class" in card
    assert "## Metrics" in card and "test/acc" in card and "Git commit: `" in card
    assert yaml.safe_load((run / "outcome.yaml").read_text())["status"] == "completed"
    assert (run / "run.yaml").is_file() and (run / "config.yaml").is_file()


@pytest.mark.slow
def test_export_output_names_the_file_and_the_card_goes_beside_it(
    quickstart_checkpoint: Path, tmp_path: Path
):
    output = tmp_path / "deploy" / "digits.onnx"
    assert_ok(
        run_export(tmp_path / "logs", quickstart_checkpoint, "export.format=onnx", f"export.output={output}")
    )
    assert output.is_file() and (output.parent / "model_card.md").is_file()
    assert "digits.onnx" in (output.parent / "model_card.md").read_text()


@pytest.mark.slow
def test_a_users_own_lightning_module_exports_to_onnx(tmp_path: Path):
    """tests/differential/user_code.py: a LightningModule and a DataModule written the way Lightning's
    documentation writes them (flat float vectors, no preprocessing), configured with hydra.searchpath."""
    env = {"PYTHONPATH": str(ROOT)}
    logs = tmp_path / "logs"
    assert_ok(train(logs, *user_overrides("LitClassifier"), "trainer=cpu", "trainer.max_epochs=1", env=env))
    (trained,) = run_dirs(logs)
    checkpoint = trained / "checkpoints" / "last.ckpt"
    assert_ok(run_export(logs, checkpoint, "export.format=onnx", *user_code("LitClassifier"), env=env))
    (run,) = run_dirs(logs, task="export")

    from tests.differential.user_code import _digits

    inputs = _digits(CHECKED)[0]
    with torch.no_grad():
        want = hpctrain.load(checkpoint, user_code("LitClassifier"))(inputs)
    assert_same_predictions(outputs_without_the_template("onnx", run / "model.onnx", inputs, tmp_path), want)
    card = (run / "model_card.md").read_text()
    assert "LitClassifier on DigitsData" in card and "float32 (N, 64)" in card and "**onnx**" in card


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_a_model_that_cannot_be_traced_is_one_sentence(fmt: str, tmp_path: Path):
    """tests/unexportable.py branches on its input's values: the sentence names the format, torch's
    reason and the line of the model's code, and torch's graph dumps stay off the terminal."""
    from tests.unexportable import BranchingClassifier

    checkpoint = tmp_path / "branching.ckpt"
    config = {
        "model": {"_target_": "tests.unexportable.BranchingClassifier"},
        "data": {"_target_": "tests.differential.user_code.DigitsData", "batch_size": 8},
    }
    torch.save({"state_dict": BranchingClassifier().state_dict(), CONFIG_KEY: config}, checkpoint)
    classes = [o for o in user_code("LitClassifier") if not o.startswith("model._target_=")]
    classes.append("model._target_=tests.unexportable.BranchingClassifier")  # its classes, as at training
    result = run_export(
        tmp_path / "logs", checkpoint, f"export.format={fmt}", *classes, env={"PYTHONPATH": str(ROOT)}
    )

    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
    assert f"export.format={fmt} cannot export this model: " in errors[0]
    assert (
        "data-dependent" in errors[0]
        and "tests/unexportable.py:" in errors[0]
        and "if x.mean() > 0.5" in errors[0]
    )
    assert "Traceback" not in result.stdout and "def forward" not in result.stdout
    (run,) = run_dirs(tmp_path / "logs", task="export")
    assert yaml.safe_load((run / "outcome.yaml").read_text())["status"] == "failed"
    assert not (run / f"model{SUFFIX[fmt]}").exists()


LAUNCHED_AS_MANY = {
    "trainer_devices": ({}, ["trainer.devices=2"], "trainer.devices=2 ask for 2"),
    "trainer_num_nodes": ({}, ["trainer.num_nodes=2"], "trainer.num_nodes=2"),
    "torchrun_workers": (
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"},
        [],
        "one of 2 torchrun workers",
    ),
    "slurm_tasks": (
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"},
        [],
        "one of 4 tasks of this SLURM step",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAUNCHED_AS_MANY))
def test_more_than_one_process_is_refused_in_one_sentence(case: str, tmp_path: Path):
    env, overrides, says = LAUNCHED_AS_MANY[case]
    result = run_export(tmp_path / "logs", tmp_path / "any.ckpt", *overrides, env=env, timeout=60)
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "export runs in one process, but " in errors[0] and says in errors[0]


# ------------------------------------------------------------------------------------------ in-process


def test_the_export_config_composes_with_its_defaults(tmp_path: Path):
    cfg = compose("export", [f"paths.output_dir={tmp_path}", "ckpt_path=x.ckpt"])
    assert cfg.task_name == "export" and cfg.export.format == "torch_export" and cfg.export.output is None
    assert cfg.export.batch_size == TRACED and cfg.trainer.devices == 1 and not cfg.requeue.enabled


def test_the_schema_names_every_format():
    assert set(export.FORMATS) == set(EXPORT_FORMATS) == set(SUFFIX)
    assert all(export.FORMATS[name].suffix == SUFFIX[name] for name in SUFFIX)


def test_a_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch):
    require_modules("onnx")  # the case below: onnx installed, onnxscript (the other half) missing
    found = export.importlib.util.find_spec
    monkeypatch.setattr(
        export.importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else found(name, *a)
    )
    with pytest.raises(UserError) as refused:
        export.check_installed("onnx")
    sentence = str(refused.value)
    assert "export.format=onnx needs onnxscript" in sentence and "pip install -e '.[export]'" in sentence
    assert "make install" in sentence
    assert export.check_installed("torch_export").suffix == ".pt2"  # torch alone


def test_an_output_with_another_formats_suffix_is_refused(tmp_path: Path):
    assert export.output_path(export.FORMATS["onnx"], None, tmp_path) == tmp_path / "model.onnx"
    assert export.output_path(export.FORMATS["onnx"], "a/b.onnx", tmp_path) == Path("a/b.onnx")
    with pytest.raises(UserError, match=r"does not end in \.pt2"):
        export.output_path(export.FORMATS["torch_export"], "model.onnx", tmp_path)


def test_an_exporters_reason_is_its_first_meaningful_line_and_the_models_line():
    def forward():
        raise RuntimeError(
            'Constraints violated (batch)! For more information, run with TORCH_LOGS="+dynamic".\n'
            "  - You marked batch as dynamic but your code specialized it to be a constant (2). If you're ..."
        )

    try:
        try:
            forward()
        except RuntimeError as inner:
            raise ValueError("Failed to export the model. This is step 1/3.") from inner
    except ValueError as err:
        reason = exporter_errors.reason(err)
    assert reason.startswith(
        "You marked batch as dynamic but your code specialized it to be a constant (2), at "
    )
    assert "tests/test_export.py:" in reason and "raise RuntimeError(" in reason
