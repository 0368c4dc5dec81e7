"""k-fold cross-validation (`data.num_folds`, `data.fold`, `data.fold_seed`): the validation folds are
disjoint and cover the training data, are the same for the same fold_seed and stratified by class; the
datamodules fold their train and val splits (in memory, image folders, shards, text) and keep their
test split; bad settings are one sentence, found by the preflight before anything heavy runs."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hpctrain import UserError
from hpctrain.data import check_folds, folds
from hpctrain.runtime.config.checks import check_config
from tests.helpers import EXAMPLES, assert_ok, compose_train, last_value, read_metrics, run_dirs, train

LABELS = np.random.RandomState(0).randint(0, 7, 503)  # seven classes of uneven sizes


@pytest.mark.parametrize("data", [LABELS, len(LABELS), LABELS.tolist(), torch.from_numpy(LABELS)])
def test_the_validation_folds_are_disjoint_and_cover_the_training_data(data):
    held = []
    for fold in range(5):
        train, val = folds(data, 5, fold, seed=3)
        assert train.dtype == val.dtype == np.int64
        assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(len(LABELS)))
        assert np.array_equal(train, np.sort(train)) and np.array_equal(val, np.sort(val))
        held.append(val)
    every = np.concatenate(held)
    assert np.array_equal(np.sort(every), np.arange(len(LABELS)))  # disjoint, and every sample once
    assert max(map(len, held)) - min(map(len, held)) <= 1


def test_folds_are_the_same_for_the_same_seed_and_differ_for_another():
    first = folds(LABELS, 4, 2, seed=11)
    again = folds(LABELS.copy(), 4, 2, seed=11)
    other = folds(LABELS, 4, 2, seed=12)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[1], other[1])
    # numpy's RandomState stream is frozen across numpy releases: these indices hold everywhere
    assert folds(10, 3, 0, seed=0)[1].tolist() == [2, 5, 7, 9]


def test_folds_are_stratified_by_class():
    counts = np.bincount(LABELS)
    for fold in range(5):
        _, val = folds(LABELS, 5, fold)
        per_class = np.bincount(LABELS[val], minlength=len(counts))
        assert np.all(np.abs(per_class - counts / 5) < 1), (fold, per_class, counts / 5)
    # string labels too
    names = np.array(["cat", "dog", "dog", "cat", "dog", "dog"])
    _, val = folds(names, 2, 0)
    assert sorted(names[val]) == ["cat", "dog", "dog"]


def _rows(part) -> Counter:
    """The samples of an in-memory split, as a multiset of (image bytes, label)."""
    return Counter(
        (image.numpy().tobytes(), int(label)) for image, label in zip(part.images, part.labels, strict=True)
    )


@pytest.mark.skipif(not EXAMPLES, reason="a project generated without the examples has no digits datamodule")
def test_digits_fold_their_training_data_and_keep_their_test_split():
    from myproject.data.digits import DigitsDataModule

    plain = DigitsDataModule()
    plain.setup()
    for off in (DigitsDataModule(num_folds=None, fold=None, fold_seed=7), DigitsDataModule(num_folds=0)):
        off.setup()  # without num_folds: the datamodule's own split, bit for bit
        for a, b in zip(plain.splits, off.splits, strict=True):
            assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    training = _rows(plain.splits[0]) + _rows(plain.splits[1])
    validated = Counter()
    for fold in range(3):
        module = DigitsDataModule(num_folds=3, fold=fold, fold_seed=5)
        module.setup()
        train, val, test = module.splits
        assert torch.equal(test.images, plain.splits[2].images) and torch.equal(
            test.labels, plain.splits[2].labels
        )
        assert _rows(train) + _rows(val) == training
        assert len(val) in (479, 480) and len(train) + len(val) == 1438
        per_class = np.bincount(val.labels.numpy(), minlength=10)  # stratified: a third of each class
        assert np.all(np.abs(per_class - np.bincount([label for _, label in training.elements()]) / 3) < 1)
        validated += _rows(val)
    assert validated == training  # the three validation folds: every training sample once


def test_image_folders_and_shards_fold_by_file(data_dir: Path):
    from hpctrain.data.files import ImageFolderDataModule
    from hpctrain.data.shards import ShardsDataModule

    common = {"num_classes": 10, "image_shape": (1, 28, 28)}
    folder = data_dir / "digits_images"
    plain = ImageFolderDataModule(root=str(folder), **common)
    plain.setup()
    everything = Counter(map(bytes, [*plain.splits[0].names, *plain.splits[1].names]))
    for kind, root in ((ImageFolderDataModule, folder), (ShardsDataModule, data_dir / "digits_shards")):
        validated = Counter()
        for fold in range(2):
            module = kind(root=str(root), num_folds=2, fold=fold, **common)
            module.setup()
            train, val, test = module.splits
            assert Counter(map(bytes, [*train.names, *val.names])) == everything
            assert list(test.names) == list(plain.splits[2].names)
            for part in (train, val):  # every file read from where it is: its folder file's bytes
                for i in (0, len(part) // 2, len(part) - 1):
                    assert part.read(i) == (folder / part.name(i)).read_bytes()
                    assert int(part.labels[i]) == int(part.name(i).split("/")[1])
            images, labels = val[torch.arange(len(val))]
            assert images.shape == (len(val), 1, 28, 28) and bool((labels >= 0).all())
            validated += Counter(map(bytes, val.names))
        assert validated == everything


@pytest.mark.skipif(not EXAMPLES, reason="a project generated without the examples has no text datamodule")
def test_text_folds_are_contiguous_blocks_no_window_crosses():
    from myproject.data.text import StdlibTextDataModule

    plain = StdlibTextDataModule(block_size=64)
    plain.setup()
    test_start = int(plain.splits[2].starts[0])
    blocks = []
    for fold in range(3):
        module = StdlibTextDataModule(block_size=64, num_folds=3, fold=fold)
        module.setup()
        train, val, test = module.splits
        assert torch.equal(test.starts, plain.splits[2].starts)
        low, high = int(val.starts[0]), int(val.starts[-1]) + 65
        assert high <= test_start
        ends = train.starts + 65  # a window reads block_size + 1 bytes
        assert bool(((ends <= low) | (train.starts >= high)).all())  # no training window reads the fold
        assert int(ends.max()) <= test_start
        blocks.append((low, high))
    assert blocks[0][0] == 0 and blocks[0][1] <= blocks[1][0] and blocks[1][1] <= blocks[2][0]


@pytest.mark.parametrize(
    ("num_folds", "fold", "sentence"),
    [
        (
            None,
            2,
            "data.fold=2 but data.num_folds is not set, so there are no folds; pass the number of folds with it "
            "(e.g. data.num_folds=5), or leave data.fold out.",
        ),
        (
            1,
            0,
            "data.num_folds=1 cannot split the training data into folds; pass 2 or more (e.g. data.num_folds=5), "
            "or null for the datamodule's own train/val split.",
        ),
        (
            5,
            None,
            "data.num_folds=5 needs data.fold, the fold to validate on; pass data.fold=0 (folds 0 to 4), or sweep "
            "them all: -m 'data.fold=range(5)'.",
        ),
        (5, 5, "data.fold=5 is not a fold of data.num_folds=5; pass data.fold between 0 and 4."),
        (3, -1, "data.fold=-1 is not a fold of data.num_folds=3; pass data.fold between 0 and 2."),
        (2.5, 0, "data.num_folds=2.5 is not an integer; pass e.g. data.num_folds=5."),
    ],
)
def test_bad_fold_settings_are_one_sentence(num_folds, fold, sentence: str):
    with pytest.raises(UserError) as raised:
        check_folds(num_folds, fold)
    assert str(raised.value) == sentence
    with pytest.raises(UserError, match=re.escape(sentence)):
        folds(LABELS, num_folds, fold)


def test_more_folds_than_samples_of_a_class_is_one_sentence():
    labels = [0] * 10 + [1] * 3 + [2] * 10
    with pytest.raises(UserError) as raised:
        folds(labels, 5, 0)
    assert str(raised.value) == (
        "data.num_folds=5 but class 1 has only 3 training sample(s), so some folds would validate on none of "
        "it; pass data.num_folds=3 or fewer, or leave data.num_folds out (null)."
    )
    with pytest.raises(
        UserError,
        match=r"^data.num_folds=5 but the training data has only 4 sample\(s\); pass data.num_folds=4 or fewer.$",
    ):
        folds(4, 5, 0)
    with pytest.raises(UserError, match=r"^data.fold_seed=-1 is not an integer"):
        folds(10, 2, 0, seed=-1)
    assert (
        check_folds(None, None) is None and check_folds(0, None) is None and check_folds(np.int64(3), 1) == 3
    )


@pytest.mark.skipif(not EXAMPLES, reason="a project generated without the examples has no digits data config")
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.num_folds=3"], "data.num_folds=3 needs data.fold"),
        (["data.fold=1"], "data.fold=1 but data.num_folds is not set"),
        (["data.num_folds=3", "data.fold=3"], "data.fold=3 is not a fold of data.num_folds=3"),
        (["data.num_folds=1", "data.fold=0"], "data.num_folds=1 is not an integer, 2 or more, or null"),
    ],
)
def test_the_preflight_checks_the_fold_settings(tmp_path: Path, overrides: list[str], message: str):
    cfg = compose_train(tmp_path, tmp_path, "experiment=quickstart", *overrides)
    with pytest.raises(UserError, match=re.escape(message)):
        check_config(cfg)


@pytest.mark.skipif(not EXAMPLES, reason="a project generated without the examples has no digits data config")
def test_the_preflight_passes_a_fold_of_the_folds(tmp_path: Path):
    check_config(
        compose_train(tmp_path, tmp_path, "experiment=quickstart", "data.num_folds=3", "data.fold=2")
    )


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES, reason="a project generated without the examples has no digits data")
def test_a_run_validates_on_its_fold_and_tests_on_the_test_split(tmp_path: Path):
    result = train(
        tmp_path, "experiment=quickstart", "trainer.max_epochs=1", "data.num_folds=3", "data.fold=1"
    )
    assert_ok(result)
    # the digits' 1,438 training samples (train and val) in three folds; fold 1 validated on, 359 tested
    assert (
        "k-fold: fold 1 of 3 (data.fold_seed=0) validates on 479 of the 1438 training samples and trains on "
        "the other 959, stratified by class; the test split (359) is unchanged"
    ) in result.stdout
    (run_dir,) = run_dirs(tmp_path)
    rows = read_metrics(run_dir)
    assert 0 <= last_value(rows, "val/acc") <= 1 and 0 <= last_value(rows, "test/acc") <= 1
    outcome = yaml.safe_load((run_dir / "outcome.yaml").read_text())  # what sweep summaries group
    assert outcome["test"]["test/acc"] == pytest.approx(last_value(rows, "test/acc"))
