"""Every option the schema offers, under every strategy the template ships, runs or is refused in one sentence
(exit status 2) before the first step: never a traceback, never a hang. The cells are generated from the
typed schema (tests/pairwise.py): every pair of values of any two options, strategies, models and data
shapes is in some cell. CI runs the few cells in which every value appears at least once; the others run
with `pytest --ondemand` (docs/reference/combinations.md). A cell trains two batches and tests: it proves
that the combination runs, not that it learns."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
from pathlib import Path

import pytest

from hpctrain.runtime.config.settings import FSDP, Dist, Settings, all_keys, flag, setting
from tests import pairwise
from tests.helpers import EXAMPLES, train

CELLS, REFUSED = pairwise.generated()
IN_CI = set(pairwise.every_value_once(CELLS))
# Runs that take seconds, the sanity check over every validation batch (an uneven split's too), a short
# collective timeout so that a hang fails within a minute
SHORT = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.num_sanity_val_steps=-1",
    "trainer.log_every_n_steps=1",
    "dist.timeout_min=0.25",
    "dist.init_timeout_min=0.5",
    "compile_backend=aot_eager",  # what inductor compiles, without its C++ build (minutes on a CPU)
)
MODELS = {
    "cnn": ("experiment=quickstart", "data.batch_size=4"),
    "transformer": (
        "experiment=char_transformer",
        "model.net.n_layer=2",
        "model.net.n_embd=64",
        "model.net.n_head=4",
        "data.batch_size=4",
        "data.block_size=32",
        "callbacks.text_sample.length=4",
    ),
}
# Validation and test samples of each shape (2 ranks, batches of 4): 16 and 40 share evenly; 17 and 41
# leave the ranks one batch apart when batched plainly; 18 and 42 end every rank on a smaller batch
SIZES = {"even": (16, 40), "uneven": (17, 41), "small_last_batch": (18, 42)}


@functools.cache
def _corpus_size() -> int:
    from myproject.data.text import stdlib_corpus

    return len(stdlib_corpus()[0])


def _shape(model: str, shape: str) -> list[str]:
    """The fractions that make SIZES's samples: digits (1797 images) or windows of 32 bytes of text."""
    val, test = SIZES[shape]
    if model == "cnn":
        return [f"data.val_fraction={val / 1797}", f"data.test_fraction={test / 1797}"]
    size = _corpus_size()  # n windows of 32 (+1 byte of target) take 33 + 32 (n - 1) bytes and up to 31 more
    return [
        f"data.val_fraction={(48.5 + 32 * (val - 1)) / size}",
        f"data.test_fraction={(48.5 + 32 * (test - 1)) / size}",
    ]


def command(cell: dict) -> list[str]:
    return [
        *MODELS[cell["model"]],
        *pairwise.STRATEGIES[cell["strategy"]],
        *_shape(cell["model"], cell["shape"]),
        *SHORT,
        *pairwise.overrides(cell),
    ]


def _sentence(result: subprocess.CompletedProcess[str]) -> str | None:
    """None for a run that completed; else its one sentence, which ended it before the first step (every
    rank may say it, alike). A traceback, another exit status or a second sentence fail the cell."""
    output = result.stdout
    assert "Traceback" not in output, output[-6000:]
    if result.returncode == 0:
        return None
    errors = {line for line in output.splitlines() if line.startswith("error: ")}
    assert result.returncode == 2 and len(errors) == 1, f"exit {result.returncode}\n{output[-6000:]}"
    assert not re.search(r"first training step [0-9.]+ s after", output), (
        f"refused after the first step: {errors}"
    )
    return errors.pop()


def _refused_key(cell: dict) -> str:
    keys = [k for k in cell if k not in pairwise.CONTEXT]
    return f"{keys[0]}={pairwise._shown(cell[keys[0]])}" if keys else "dist.tensor_parallel=2"


def _id(index: int) -> str:
    cell = CELLS[index]
    return f"{index}-{cell['strategy']}-{cell['model']}-{cell['shape']}"


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES, reason="the examples' experiments are not in this project")
@pytest.mark.parametrize(
    "index",
    [i if i in IN_CI else pytest.param(i, marks=pytest.mark.ondemand) for i in range(len(CELLS))],
    ids=_id,
)
def test_a_cell_the_preflight_admits_runs(index: int, tmp_path: Path):
    """Fit (two batches) and the test after fit; a refusal after the preflight admitted the cell would stop
    the cell's other pairs from running: a value to refuse in the preflight, or one the model refuses
    (`pairwise.REFUSED_BY_MODEL`)."""
    result = train(tmp_path, *command(CELLS[index]), timeout=240)
    assert _sentence(result) is None, _sentence(result)


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES, reason="the examples' experiments are not in this project")
@pytest.mark.parametrize(
    "refused",
    REFUSED,
    ids=[f"{_refused_key(c)}-{c['strategy']}-{c['model']}" for c in REFUSED],
)
def test_a_value_the_preflight_refuses_is_one_sentence_naming_its_key(refused: dict, tmp_path: Path):
    """Each in CI: a refusal before the first step costs a second or two. A cell of a context alone (a
    strategy that needs another model: tensor parallelism without a plan) names the strategy's key."""
    key = _refused_key(refused).split("=")[0]
    sentence = _sentence(train(tmp_path, *command(refused), timeout=240))
    assert sentence is not None and f"{key}=" in sentence, sentence


@pytest.mark.slow  # the preflight asked about every pair the cells leave out: seconds, not the quick tier's
def test_every_pair_of_values_runs_in_a_cell_unless_refused_and_ci_sees_every_value():
    """A pair missing from the cells that run is one the preflight (or the model) refuses, which its value's
    own cell shows."""
    chosen = pairwise.factors()
    names = list(chosen)
    seen = {(a, pairwise._shown(c[a]), b, pairwise._shown(c[b])) for c in CELLS for a in names for b in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for x in chosen[a]:
                for y in chosen[b]:
                    if (a, pairwise._shown(x), b, pairwise._shown(y)) not in seen:
                        assert _refused({a: x, b: y}), (a, x, b, y)
    in_ci = {(k, pairwise._shown(v)) for i in IN_CI for k, v in CELLS[i].items()}
    in_ci |= {(k, pairwise._shown(v)) for c in REFUSED for k, v in c.items()}
    assert in_ci == {(k, pairwise._shown(v)) for k, vs in chosen.items() for v in vs}
    assert len(IN_CI) <= 12 < len(CELLS)


def _refused(pair: dict) -> bool:
    """Refused in every context (strategy and model), the other keys at their defaults."""
    chosen, contexts = pairwise.factors(), pairwise._contexts()
    return all(pairwise.refusal({**pairwise._defaults(chosen, c), **pair}) is not None for c in contexts)


@pytest.mark.slow  # a generation of the cells: seconds, not the quick tier's
def test_a_key_added_to_a_settings_dataclass_joins_the_cells():
    """A new FSDP2 switch and a new choice at the top level, as a change to settings.py would add them."""
    more = dataclasses.make_dataclass(
        "FSDP", [("overlap_gathers", bool, flag(False, "true"))], bases=(FSDP,), frozen=True
    )
    dist = dataclasses.make_dataclass(
        "Dist", [("fsdp", more, dataclasses.field(default_factory=more))], bases=(Dist,), frozen=True
    )
    kind = dataclasses.make_dataclass(
        "Settings",
        [
            ("dist", dist, dataclasses.field(default_factory=dist)),
            (
                "attention",
                str,
                setting("sdpa", {"enum": ["sdpa", "flash", "eager"]}, "sdpa, flash or eager", "flash"),
            ),
        ],
        bases=(Settings,),
        frozen=True,
    )
    found, _ = pairwise.cells(all_keys(kind))
    assert {c["dist.fsdp.overlap_gathers"] for c in found} == {False, True}
    assert {c["attention"] for c in found} == {"sdpa", "flash", "eager"}
    assert "dist.fsdp.overlap_gathers=true" in pairwise.overrides(
        next(c for c in found if c["dist.fsdp.overlap_gathers"])
    )
