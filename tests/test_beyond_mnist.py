"""Beyond MNIST: CIFAR-10 read from its official batches and augmented on the device, ResNet-18 under
DDP, a character Transformer on the standard library's source, and the compile / channels-last switches."""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpctrain.data.images import DataUnavailable
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.run import build
from myproject.data.cifar import CIFAR10DataModule, random_crop_and_flip
from myproject.data.text import STDLIB_FILES, StdlibTextDataModule, stdlib_corpus
from myproject.models.language_model import CharLanguageModel
from myproject.models.sampling import TextSample
from myproject.models.transformer import CharTransformer
from tests.helpers import (
    assert_ok,
    compose_train,
    last_value,
    read_metrics,
    run_dirs,
    run_entry,
    run_script,
    train,
)


def test_cifar10_reads_the_official_batches(data_dir: Path):
    data = CIFAR10DataModule(str(data_dir), download=False, val_size=500)
    data.check_available()
    data.setup()
    train_set, val, test = data.splits
    assert (len(train_set), len(val), len(test)) == (5 * 1100 - 500, 500, 200)
    assert train_set.images.shape[1:] == (3, 32, 32) and train_set.images.dtype == torch.uint8


def test_missing_or_booby_trapped_cifar_is_one_sentence(tmp_path: Path, data_dir: Path):
    with pytest.raises(
        DataUnavailable, match=r"CIFAR-10 is not in .*cifar-10-batches-py and data.download=false"
    ):
        CIFAR10DataModule(str(tmp_path), download=False).check_available()
    trapped = tmp_path / "trap" / "cifar-10-batches-py"
    trapped.mkdir(parents=True)
    for path in (data_dir / "cifar-10-batches-py").iterdir():
        (trapped / path.name).write_bytes(path.read_bytes())
    (trapped / "test_batch").write_bytes(pickle.dumps({b"data": SimpleNamespace(), b"labels": []}))
    with pytest.raises(
        DataUnavailable, match=r"missing, corrupt or truncated \(UnpicklingError: unexpected object"
    ):
        CIFAR10DataModule(str(tmp_path / "trap"), download=False).check_available()


def test_crop_and_flip_keep_shape_dtype_and_are_reproducible():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    torch.manual_seed(3)
    first = random_crop_and_flip(images, 4, True)
    torch.manual_seed(3)
    again = random_crop_and_flip(images, 4, True)
    assert first.shape == images.shape and first.dtype == torch.uint8 and torch.equal(first, again)
    changed = (first != images).flatten(1).any(1).float().mean()
    assert 0.5 < changed <= 1.0  # most images moved or mirrored
    assert torch.equal(random_crop_and_flip(images, 0, False), images)


class _CountingCIFAR(CIFAR10DataModule):
    augmented = 0

    def augment(self, images):
        # the class by name: a datamodule of hpctrain's bases is made of the run's Lightning namespace
        # (hpctrain.runtime.namespaces), a subclass of this class with its name, so type(self) is not it
        _CountingCIFAR.augmented += len(images)
        return super().augment(images)


@pytest.mark.slow
def test_augmentation_touches_training_batches_only(tmp_path: Path, data_dir: Path):
    cfg = compose_train(
        tmp_path,
        data_dir,
        "experiment=cifar10_resnet18",
        "debug=fdr",
        "trainer=cpu",
        "data.batch_size=4",
        "trainer.precision=32-true",
        "model/net=mlp",
    )
    data = _CountingCIFAR(str(data_dir), download=False, batch_size=4)
    trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    trainer.fit(build.model(cfg.model), data)  # one training batch, one validation batch
    trainer.test(build.model(cfg.model), data)
    assert _CountingCIFAR.augmented == 4  # the training batch only; labels travel unchanged alongside


@pytest.mark.slow
def test_resnet18_on_cifar_trains_with_ddp(tmp_path: Path, data_dir: Path):
    result = train(
        tmp_path,
        "experiment=cifar10_resnet18",
        "trainer=ddp_cpu",
        f"paths.data_dir={data_dir}",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "data.batch_size=16",
        "trainer.precision=32-true",
    )
    assert_ok(result)
    (run,) = run_dirs(tmp_path)
    assert (run / "checkpoints" / "last.ckpt").is_file() and "processes: 2" in result.stdout


def test_the_text_corpus_is_the_recorded_one():
    text, used, skipped = stdlib_corpus()
    assert len(text) > 300_000
    assert len(used) + len(skipped) == len(STDLIB_FILES) and len(used) >= len(STDLIB_FILES) / 2
    data = StdlibTextDataModule(block_size=32, batch_size=4)
    data.setup()
    inputs, targets = next(iter(data.train_dataloader()))
    assert inputs.shape == targets.shape == (4, 32) and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_a_text_sample_leaves_the_training_randomness_alone():
    torch.manual_seed(0)
    module = CharLanguageModel(
        CharTransformer(block_size=16, n_layer=1, n_embd=32, n_head=2), partial(torch.optim.SGD, lr=0.1)
    )
    sample = TextSample(prompt="def ", length=20)
    state = torch.get_rng_state()
    sample.on_validation_end(
        SimpleNamespace(sanity_checking=False, is_global_zero=True, current_epoch=0), module
    )
    assert (
        torch.equal(torch.get_rng_state(), state) and sample.last.startswith("def ") and module.net.training
    )


@pytest.mark.slow
def test_the_transformers_loss_falls(tmp_path: Path):
    result = train(
        tmp_path,
        "experiment=char_transformer",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=20",
        "trainer.limit_val_batches=5",
        "trainer.limit_test_batches=5",
        "model.net.n_layer=2",  # a quarter of the recipe's compute per step: the loss falls all the same
        "model.net.n_embd=64",
        "data.block_size=64",
        "callbacks.text_sample.length=20",
    )
    assert_ok(result)
    rows = read_metrics(run_dirs(tmp_path)[0])
    losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(losses) == 2 and losses[1] < losses[0] < 5.0  # below ln(256) = 5.55, uniform guessing
    assert "sample after epoch 1:" in result.stdout and last_value(rows, "test/bpc") < 6


@pytest.mark.slow
def test_compile_keeps_checkpoints_interchangeable(tmp_path: Path):
    """Trained compiled under DDP, its checkpoint has the keys of the plain model, resumes compiled and
    is evaluated without compiling."""
    quick = ("experiment=quickstart", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2")
    compiled = (
        "compile=true",
        "compile_backend=aot_eager",
    )  # dynamo's graph capture, without inductor's C++ build
    assert_ok(train(tmp_path, *quick, "trainer=ddp_cpu", "trainer.max_epochs=1", *compiled))
    (run,) = run_dirs(tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    stored = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    cfg = compose_train(tmp_path, tmp_path, "experiment=quickstart")
    assert set(stored) == set(build.model(cfg.model).state_dict())
    assert_ok(train(tmp_path, *quick, "trainer.max_epochs=2", *compiled, f"ckpt_path={last}"))
    assert_ok(run_entry("eval.py", f"paths.log_dir={tmp_path}", f"ckpt_path={last}"))


@pytest.mark.slow
def test_channels_last_runs_and_formats_the_parameters(tmp_path: Path, data_dir: Path):
    cfg = compose_train(
        tmp_path,
        data_dir,
        "experiment=cifar10_resnet18",
        "debug=fdr",
        "trainer=cpu",
        "data.batch_size=4",
        "trainer.precision=32-true",
        "channels_last=true",
    )
    module = build.model(cfg.model, Settings.of(cfg))  # with the template's switches
    assert module.net.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    trainer.fit(module, build.datamodule(cfg.data, Settings.of(cfg)))


@pytest.mark.slow
@pytest.mark.parametrize("data", ["cifar10 data.download=false", "pystdlib_text"])
def test_prepare_data_covers_every_dataset(data: str, data_dir: Path):
    result = run_script(
        "scripts/prepare_data.py", f"data={data.split()[0]}", *data.split()[1:], f"paths.data_dir={data_dir}"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "samples ready" in result.stdout


def test_every_augmented_image_is_a_crop_of_its_padded_image_maybe_mirrored():
    import torch.nn.functional as F

    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    out = random_crop_and_flip(images, 2, True)
    padded = F.pad(images, (2, 2, 2, 2))
    for k in range(len(images)):
        candidates = [padded[k, :, y : y + 8, x : x + 8] for y in range(5) for x in range(5)]
        assert any(torch.equal(out[k], c) or torch.equal(out[k], c.flip(2)) for c in candidates)
