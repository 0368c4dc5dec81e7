"""k-fold cross-validation: which samples of the training data fold i validates on.

`folds(labels, num_folds, fold, seed)` deals the samples out to `num_folds` folds, class by class: the
samples are shuffled (by `seed` alone), ordered by class, and sample j of that order goes to fold
j % num_folds. So every class is spread over the folds as evenly as it can be (its counts per fold
differ by one at most), and so are the fold sizes. Fold `fold` is the validation set, the other folds
the training set; the K validation sets are disjoint and together cover the data.

The generator is numpy's `RandomState`, whose stream numpy keeps unchanged across its releases: a fold
holds the same samples with every numpy version. No torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np

from hpctrain.runtime.config import checks
from hpctrain.runtime.errors import UserError


def check_folds(num_folds: Any, fold: Any) -> int | None:
    """`data.num_folds` and `data.fold` checked, one sentence if wrong: None when k-fold is off (both null,
    or num_folds 0), else the number of folds. The preflight checks a config with the same function."""
    return checks.check_folds(num_folds, fold)


def folds(
    n_or_labels: int | Sequence[Any] | np.ndarray | Any, num_folds: int, fold: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices) of fold `fold` of `num_folds`, each sorted, as int64 arrays.

    `n_or_labels`: the number of samples (plain k-fold), or one label per sample (a list, numpy array or
    CPU tensor: stratified k-fold, each class spread evenly over the folds). Deterministic given `seed`.
    """
    num_folds = check_folds(num_folds, fold)  # type: ignore[assignment]
    if num_folds is None:
        raise UserError(
            f"k-fold got data.num_folds={num_folds!r} and data.fold={fold!r}; pass both, e.g. data.num_folds=5 "
            "data.fold=0."
        )
    if not isinstance(seed, Integral) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise UserError(
            f"data.fold_seed={seed!r} is not an integer from 0 to 2**32-1; pass e.g. data.fold_seed=0."
        )
    if isinstance(n_or_labels, Integral):
        labels = np.zeros(int(n_or_labels), dtype=np.int64)
    else:
        labels = np.asarray(n_or_labels)
        if labels.ndim != 1:
            raise ValueError(f"labels must be one per sample (1-D), not an array of shape {labels.shape}")
    size = len(labels)
    classes, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if size < num_folds:
        fix = f"pass data.num_folds={size} or fewer" if size >= 2 else "k-fold needs 2 samples or more"
        raise UserError(f"data.num_folds={num_folds} but the training data has only {size} sample(s); {fix}.")
    if counts.min() < num_folds:
        rare = int(counts.argmin())
        label, fewest = classes[rare].item(), int(counts[rare])
        fix = (
            f"pass data.num_folds={fewest} or fewer"
            if fewest >= 2
            else "give that class more samples or leave it out of the training data"
        )
        raise UserError(
            f"data.num_folds={num_folds} but class {label!r} has only {fewest} training sample(s), so "
            f"some folds would validate on none of it; {fix}, or leave data.num_folds out (null)."
        )
    shuffled = np.random.RandomState(int(seed)).permutation(size)
    dealt = shuffled[np.argsort(codes.reshape(-1)[shuffled], kind="stable")]  # by class, shuffled within
    assigned = np.empty(size, dtype=np.int64)
    assigned[dealt] = np.arange(size) % num_folds
    return np.flatnonzero(assigned != fold), np.flatnonzero(assigned == fold)
