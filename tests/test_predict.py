"""src/predict.py as users run it: every sample once, in input order, on one process or two; a folder of
image files or a tensor file as input; a user's own predict_step and predict_dataloader; bad input as
one sentence. (A signal during prediction under SLURM: tests/test_slurm.py.)"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.differential.cases import user_code, user_overrides
from tests.helpers import ROOT, run_entry

PROJECT_ON_PATH = {"PYTHONPATH": str(ROOT)}  # the user's module lives in tests/differential/user_code.py


def _checkpoint(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> Path:
    result = run_entry(
        "train.py", *overrides, f"hydra.run.dir={run_dir}", "extras.print_config=false", env=env
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def digits_checkpoint(quickstart_run: Path) -> Path:
    """The template's classifier (quickstart's CNN on digits), trained once per session."""
    return quickstart_run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's LightningModule with its own predict_step, and a datamodule with a predict_dataloader."""
    return _checkpoint(
        tmp_path_factory.mktemp("user"),
        *user_overrides("PredictingClassifier", data="PredictData"),
        "trainer=cpu",
        "trainer.max_epochs=1",
        env=PROJECT_ON_PATH,
    )


def _predict(tmp_path: Path, name: str, *overrides: str, env: dict[str, str] | None = None) -> Path:
    output = tmp_path / name
    result = run_entry(
        "predict.py", *overrides, f"predict.output={output}", f"paths.log_dir={tmp_path}/logs", env=env
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert not list((tmp_path / "logs").rglob("part-rank*.pt"))  # the parts were merged and removed
    return output


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _probabilities(rows: list[dict[str, str]]) -> torch.Tensor:
    return torch.tensor([[float(v) for k, v in row.items() if k.startswith("prob_")] for row in rows])


def _test_split(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import hpctrain

    data = instantiate(OmegaConf.create(hpctrain.load(checkpoint).config["data"]))
    data.setup()
    return data.splits[2].images, data.splits[2].labels


@pytest.mark.slow
def test_one_process_and_two_predict_every_test_sample_once_in_order(digits_checkpoint: Path, tmp_path: Path):
    import hpctrain

    one = _rows(_predict(tmp_path, "one.csv", f"ckpt_path={digits_checkpoint}"))
    two = _rows(
        _predict(
            tmp_path, "two.csv", f"ckpt_path={digits_checkpoint}", "trainer=ddp_cpu", "trainer.devices=2"
        )
    )
    images, labels = _test_split(digits_checkpoint)
    assert list(one[0]) == ["index", "path", "class", *(f"prob_{k}" for k in range(10))]
    assert [int(r["index"]) for r in one] == [int(r["index"]) for r in two] == list(range(len(labels)))
    assert [r["class"] for r in one] == [r["class"] for r in two]
    torch.testing.assert_close(_probabilities(one), _probabilities(two), rtol=1e-4, atol=1e-5)
    # the same as the loaded model on the same images, and as good as the test metric says
    with torch.no_grad():
        expected = hpctrain.load(digits_checkpoint)(images).softmax(dim=1)
    torch.testing.assert_close(_probabilities(one), expected, rtol=1e-4, atol=1e-5)
    accuracy = (torch.tensor([int(r["class"]) for r in one]) == labels).float().mean()
    assert accuracy > 0.5
    assert all(r["path"] == "" for r in one)


def _image_folder(root: Path, images: torch.Tensor) -> list[str]:
    """Grayscale PNGs as they are, RGB JPEGs at another size, one PNG stored sideways with an EXIF
    orientation tag that turns it upright: what a user's folder of images looks like."""
    from PIL import Image

    names = []
    for i, image in enumerate(images[:6]):
        pixels = image[0].numpy()
        if i % 2 == 0:
            name = f"a/{i:02d}.png"
            picture = Image.fromarray(pixels)
        else:
            name = f"b/{i:02d}.JPG"
            picture = Image.fromarray(np.stack([pixels] * 3, axis=-1)).resize((56, 56))
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if i == 4:  # stored rotated; EXIF orientation 6 says: turn it 90 degrees clockwise to show it
            exif = Image.Exif()
            exif[0x0112] = 6
            picture.transpose(Image.Transpose.ROTATE_90).save(root / name, exif=exif)
        else:
            picture.save(root / name)
        names.append(name)
    return sorted(names)


@pytest.mark.slow
def test_predict_a_folder_of_png_and_jpeg_files_and_a_tensor_file(digits_checkpoint: Path, tmp_path: Path):
    import hpctrain

    images, _ = _test_split(digits_checkpoint)
    folder = tmp_path / "images"
    names = _image_folder(folder, images)
    np.save(tmp_path / "images.npy", images[:6].numpy())

    rows = _rows(
        _predict(tmp_path, "folder.csv", f"ckpt_path={digits_checkpoint}", f"predict.input={folder}")
    )
    assert [r["path"] for r in rows] == names  # sorted by path, the path relative to the folder
    from_file = _rows(
        _predict(
            tmp_path, "file.csv", f"ckpt_path={digits_checkpoint}", f"predict.input={tmp_path}/images.npy"
        )
    )
    assert [int(r["index"]) for r in from_file] == list(range(6))

    with torch.no_grad():
        expected = hpctrain.load(digits_checkpoint)(images[:6]).softmax(dim=1)
    torch.testing.assert_close(_probabilities(from_file), expected, rtol=1e-4, atol=1e-5)
    # the PNGs hold the exact pixels (the sideways one included, once turned upright): the same predictions
    by_name = {r["path"]: r for r in rows}
    for i in (0, 2, 4):
        torch.testing.assert_close(
            _probabilities([by_name[f"a/{i:02d}.png"]])[0], expected[i], rtol=1e-4, atol=1e-5
        )


@pytest.mark.slow
def test_a_users_predict_step_and_predict_dataloader_on_two_processes(user_checkpoint: Path, tmp_path: Path):
    from tests.differential.user_code import _digits

    classes = user_code("PredictingClassifier", data="PredictData")  # as at training: a file names no code
    one = _predict(tmp_path, "one.pt", f"ckpt_path={user_checkpoint}", *classes, env=PROJECT_ON_PATH)
    two = _predict(
        tmp_path,
        "two.pt",
        f"ckpt_path={user_checkpoint}",
        *classes,
        "trainer=ddp_cpu",
        "trainer.devices=2",
        env=PROJECT_ON_PATH,
    )
    single = torch.load(one, weights_only=True)
    double = torch.load(two, weights_only=True)
    # 161 samples on two ranks: each exactly once (no padding), in the order of the user's loader
    assert single["index"].tolist() == double["index"].tolist() == list(range(161))
    torch.testing.assert_close(single["predictions"], double["predictions"], rtol=1e-4, atol=1e-5)

    from tests.differential.user_code import PredictingClassifier

    module = PredictingClassifier()
    module.load_state_dict(torch.load(user_checkpoint, weights_only=True)["state_dict"])
    module.eval()
    with torch.no_grad():
        expected = module(_digits(161)[0]).softmax(dim=-1)
    torch.testing.assert_close(single["predictions"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_users_predict_dataloader_uneven_across_ranks_under_fsdp2_is_one_sentence(
    user_checkpoint: Path, tmp_path: Path
):
    """161 samples in batches of 80: Lightning shards a project's own predict loader without padding, so
    rank 0 gets 2 batches and rank 1 one, and under FSDP2 every forward is a collective: refused before the
    first forward, instead of a hang (the template's own loaders pad: tests/test_fsdp.py)."""
    result = run_entry(
        "predict.py",
        f"ckpt_path={user_checkpoint}",
        *user_code("PredictingClassifier", data="PredictData"),  # as at training: a file names no code
        "trainer=fsdp_cpu",
        "+data.batch_size=80",  # the user's own data config has no such key: added, as its user would
        "dist.timeout_min=0.25",
        f"paths.log_dir={tmp_path}",
        env=PROJECT_ON_PATH,
    )
    assert result.returncode == 2, result.stdout[-3000:]
    assert (
        "error: the predict loaders give rank 0 2 batches and another rank 1, but under FSDP2"
        in result.stdout
    )
    assert "Traceback" not in result.stdout


@pytest.mark.slow
def test_bad_input_is_one_sentence_naming_the_file(digits_checkpoint: Path, tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "photo.png").write_bytes(b"not an image at all")
    wrong = tmp_path / "wrong.pt"
    torch.save(torch.zeros(4, 3, 28, 28, dtype=torch.uint8), wrong)
    expected = {
        empty: f"error: predict.input={empty} holds no image files (.png, .jpg, .jpeg).",
        broken: f"error: {broken}/photo.png is not a readable image (UnidentifiedImageError); remove or replace the file.",
        wrong: f"error: predict.input={wrong} holds torch.uint8 [4, 3, 28, 28]; it must be uint8 images (N, 1, 28, 28)",
    }
    for path, sentence in expected.items():
        result = run_entry(
            "predict.py",
            f"ckpt_path={digits_checkpoint}",
            f"predict.input={path}",
            f"paths.log_dir={tmp_path}/logs",
        )
        assert result.returncode == 2, result.stdout[-2000:]
        assert sentence in result.stdout, result.stdout[-2000:]
        assert "Traceback" not in result.stdout


@pytest.mark.slow  # a fresh `python src/predict.py`: the refusal comes before torch is imported
def test_an_existing_output_is_refused_before_anything_runs(tmp_path: Path):
    output = tmp_path / "predictions.csv"
    output.write_text("index,path,class\n0,,7\n")
    result = run_entry(
        "predict.py",
        f"ckpt_path={tmp_path}/any.ckpt",
        f"predict.output={output}",
        f"paths.log_dir={tmp_path}/logs",
        fresh=True,  # refused before torch is imported: a fresh interpreter answers at once
    )
    assert result.returncode == 2
    assert f"error: predict.output={output} exists already and is not overwritten" in result.stdout
    assert output.read_text() == "index,path,class\n0,,7\n"


def test_decoding_turns_resizes_and_forces_channels(tmp_path: Path):
    from PIL import Image

    from hpctrain.data.decode import decode_image

    pixels = np.arange(12 * 8, dtype=np.uint8).reshape(12, 8)  # 12 high, 8 wide
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).transpose(Image.Transpose.ROTATE_90).save(tmp_path / "sideways.png", exif=exif)
    upright = decode_image(tmp_path / "sideways.png", (1, 12, 8))
    assert upright.dtype == torch.uint8 and torch.equal(upright[0], torch.from_numpy(pixels))
    rgb = decode_image(tmp_path / "sideways.png", (3, 6, 4))
    assert rgb.shape == (3, 6, 4) and torch.equal(rgb[0], rgb[1])


def test_importing_the_package_stays_free_of_torch_until_load_is_called():
    import subprocess
    import sys

    code = "import sys, hpctrain; print(callable(hpctrain.load), 'torch' in sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
    )
    assert found.stdout.split() == ["True", "False"], found.stderr
