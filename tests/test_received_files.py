"""A received file proposes, the project disposes, and every read of it is bounded: tests generated from
each rule (docs/reference/security.md), not from a list of known tricks.

1. **A stored config is a proposal.** For every model and data option of this project, every key its
   composed config has is proposed by a file with a `_target_`, a place (a path, a folder, an action), an
   interpolation and an object: a `_target_` (or a model value that does not fit) is one sentence and
   nothing is looked up; a place and an interpolation are never taken (the project's value stands); an
   object is refused before anything is composed.
2. **Plain data, bounded.** A stored config whose nodes are shared many levels deep (a small file that
   claims a vast tree), or one of more values than a config holds, is refused within seconds and a few
   hundred MB, through the checkpoint reader.
3. **One reader for received files.** Every file kind a reader reads, replaced by a link to /dev/zero, a
   named pipe, an anchor bomb (YAML) and a claim larger than its kind holds, through the function that
   reads it: refused in one sentence, or read as absent where a missing record is normal; never blocking.
4. **Staging is confined.** A shard set's manifest naming a path out of the set, a file through a link in
   the set, or a device: nothing is copied.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.runtime.config import proposals, targets
from hpctrain.runtime.config.compose import compose, group_options
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import reading
from tests import hostile

ANCHOR_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


# ------------------------------------------------------------------------------------ 1. proposals


def _options() -> list[tuple[str, str]]:
    return [(g, o) for g in ("model", "data") for o in group_options(g)]


@pytest.mark.slow  # every model and data option composed, and every key of each proposed four ways
@pytest.mark.parametrize("group, option", _options(), ids=[f"{g}={o}" for g, o in _options()])
def test_every_key_a_file_proposes_a_target_a_place_or_an_object_at_is_never_taken(
    group: str, option: str, monkeypatch: pytest.MonkeyPatch
):
    looked_up: list[str] = []
    monkeypatch.setattr(targets, "locate", lambda name: looked_up.append(name))
    cfg = compose("train", [f"{group}={option}"])
    keys = sorted(proposals._flat_keys(cfg, group))
    assert keys, f"{group}={option} composes no keys"

    def propose(key: str, value: Any) -> Any:
        node: dict[str, Any] = {}
        here = node
        for part in key.split(".")[1:-1]:
            here = here.setdefault(part, {})
        here[key.rsplit(".", 1)[-1]] = value
        stored = {"choices": {group: option}, group: node}
        found = proposals.proposal_of(stored, "ckpt_path=f")
        composed = proposals.composed(found, [], lambda _: cfg.copy())
        return OmegaConf.select(composed, key, throw_on_resolution_failure=False)

    before = {k: OmegaConf.select(cfg, k, throw_on_resolution_failure=False) for k in keys}
    for key in keys:
        if key.endswith("._target_") or key == f"{group}._target_":
            with pytest.raises(proposals.ProposalRefused, match="which this project's configs do not give"):
                propose(key, "os.system")
        if proposals.is_place(key):
            assert propose(key, "/etc/shadow") == before[key]  # a place: this command's, never the file's
        if not proposals.is_hydras(key) and not proposals.is_place(key):
            if group == "model":
                with pytest.raises(proposals.ProposalRefused, match="was trained with"):
                    propose(key, "${oc.env:HOME}")
            else:
                assert propose(key, "${oc.env:HOME}") == before[key]  # text that would resolve: not taken
        with pytest.raises(proposals.ProposalRefused, match="where only plain values belong"):
            propose(key, b"bytes")
    assert looked_up == []


def test_a_proposals_options_are_names_of_options_and_the_command_line_chooses_first():
    for option in ("../../etc", "a,b", "${oc.env:HOME}", "x=y", "", "a b"):
        with pytest.raises(proposals.ProposalRefused, match="no group's option names"):
            proposals.proposal_of({"choices": {"model": option}}, "f")
    for group in ("trainer", "hydra/launcher", "callbacks", "../model", "model/../../x"):
        with pytest.raises(proposals.ProposalRefused, match="no group's option names"):
            proposals.proposal_of({"choices": {group: "x"}}, "f")
    found = proposals.proposal_of({"choices": {"model": "mlp", "data": "digits"}}, "f")
    assert proposals.chosen(found, ["model=mnist_cnn", "trainer=cpu"]) == {
        "data": "digits",
        "model": "mnist_cnn",
    }
    # a group the command line chooses decides its subgroups: the file's net never joins another model
    found = proposals.proposal_of({"choices": {"model": "mlp", "model/net": "mlp", "data": "digits"}}, "f")
    assert proposals.chosen(found, ["model=mnist_cnn"]) == {"data": "digits", "model": "mnist_cnn"}
    asked: list[list[str]] = []
    proposals.composed(
        found, ["model=mnist_cnn"], lambda overrides: asked.append(overrides) or OmegaConf.create()
    )
    assert asked == [["data=digits", "model=mnist_cnn"]]


# ------------------------------------------------------------------------------------ 2. plain data, bounded


def _bounded(call: Callable[[], Any], seconds: float = 5.0, megabytes: float = 300.0) -> BaseException:
    """What `call` raised, having taken at most `seconds` and `megabytes` of new Python memory."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        call()
    except BaseException as err:
        raised = err
    else:
        raise AssertionError("not refused")
    finally:
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    took = time.monotonic() - started
    assert took < seconds and peak < megabytes, (took, peak)
    return raised


@pytest.mark.parametrize("shape", ["shared", "large", "deep"])
def test_a_stored_config_that_claims_a_vast_tree_is_refused_within_seconds(shape: str, tmp_path: Path):
    if shape == "shared":  # 2**64 paths in a few hundred bytes: each level holds the one below twice
        node: Any = ["leaf"]
        for _ in range(64):
            node = {"a": node, "b": node}
    elif shape == "large":
        node = list(range(proposals.BUDGET + 1))
    else:
        node = "leaf"
        for _ in range(5000):  # deeper than any config, and than Python's recursion
            node = [node]
    path = tmp_path / "vast.ckpt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # the pickler recurses (a file can be written without it)
    try:
        torch.save({"state_dict": {}, reading.CONFIG_KEY: {"model": {"net": node}}}, path)
    finally:
        sys.setrecursionlimit(limit)
    content = reading.read(path)
    raised = _bounded(lambda: reading.proposal(path, content))
    assert isinstance(raised, UserError) and str(path) in str(raised), raised


# ------------------------------------------------------------------------------------ 3. one reader


def _dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _pipe(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _oversized(path: Path) -> None:  # a sparse file one byte larger than any file of its kind
    from hpctrain.runtime import confined

    path.unlink(missing_ok=True)
    with open(path, "wb") as file:
        file.truncate(confined.LIMITS["table"] + 1)


def _anchor_bomb(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.write_text(ANCHOR_BOMB)


REPLACEMENTS = {"a link to /dev/zero": _dev_zero, "a named pipe": _pipe, "an oversized file": _oversized}


def _run_folder(root: Path, trained: Path) -> Path:
    import shutil

    run = root / "run"
    shutil.copytree(trained, run)
    (run / "stacks").mkdir(exist_ok=True)
    (run / "stacks" / "rank0.pid").write_text("0 123 node1\n")
    return run


def _readers() -> dict[str, tuple[str, Callable[[Path], Any], bool]]:
    """file kind -> (its path in the received place, the reader, whether one that is no regular file
    reads as absent, as a record a run may lack does)."""
    from hpctrain.runtime.distributed import stacks
    from hpctrain.runtime.report import plots
    from hpctrain.runtime.storage import records
    from hpctrain.runtime.sweeps import summary

    return {
        "run.yaml": ("run.yaml", records.read_run_record, True),
        "outcome.yaml": ("outcome.yaml", records.read_outcome, True),
        "Hydra's record": (
            ".hydra/hydra.yaml",
            lambda run: reading.recorded_searchpath(run / "checkpoints" / "x"),
            True,
        ),
        "Hydra's overrides": (".hydra/overrides.yaml", lambda run: summary._overrides(run), True),
        "metrics.csv": ("metrics.csv", lambda run: plots.read_series(run / "metrics.csv"), False),
        "a rank's pid": ("stacks/rank0.pid", stacks.known_ranks, True),
        "a checkpoint": (
            "checkpoints/last.ckpt",
            lambda run: reading.read(run / "checkpoints" / "last.ckpt"),
            False,
        ),
    }


def _outcome(call: Callable[[], Any], timeout: float = 20.0) -> tuple[str, Any]:
    """("returned", value) or ("raised", exception), or a failure if the call blocks."""
    result: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            result.append(("returned", call()))
        except BaseException as err:
            result.append(("raised", err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert result, f"blocked for {timeout} s"
    return result[0]


@pytest.mark.slow  # a trained run folder (the session's), copied per file kind
@pytest.mark.parametrize("kind", sorted(_readers()))
def test_every_file_a_reader_reads_of_a_run_folder_is_regular_and_bounded(
    kind: str, trained_run: Path, tmp_path: Path
):
    where, read, absent_ok = _readers()[kind]
    replacements = dict(REPLACEMENTS)
    if where.endswith(".yaml"):
        replacements["an anchor bomb"] = _anchor_bomb
    for name, replace in replacements.items():
        run = _run_folder(tmp_path / name.replace(" ", "_").replace("/", "_"), trained_run)
        replace(run / where)
        what, value = _outcome(lambda run=run: read(run))
        if what == "raised":
            assert isinstance(value, UserError), (name, repr(value))
            assert len(str(value).splitlines()) == 1 and str(run) in str(value), (name, str(value))
        else:
            assert absent_ok and not value, (name, value)


def test_a_sharded_folders_files_are_regular_and_its_items_bounded(tmp_path: Path):
    from hpctrain.runtime.storage.checkpoints import sharded

    state = {"state_dict": {"w": torch.ones(4)}, "optimizer_0": {"param_groups": [{"lr": 0.1}]}}
    for name, replace in (*REPLACEMENTS.items(), ("no file", lambda path: path.unlink())):
        for file in (sharded.INDEX_FILE, sharded.META_FILE):
            folder = hostile.sharded_folder(tmp_path / name.replace(" ", "_") / file / "last.ckpt", state)
            if not (folder / file).exists():
                torch.save({"epoch": 0}, folder / file)
            replace(folder / file)
            what, value = _outcome(lambda folder=folder: sharded.read_folder(folder, "ckpt_path"))
            assert what == "raised" and isinstance(value, UserError), (name, file, repr(value))
    # a non-tensor item that claims more than any plain value of a checkpoint holds (a sparse shard)
    folder = hostile.sharded_folder(tmp_path / "claims" / "last.ckpt", state)
    index = sharded.read_index(folder)
    key = next(k for k in index.storage_data if k.fqn.startswith("optimizer_0"))
    info = index.storage_data[key]
    index.storage_data[key] = type(info)(info.relative_path, info.offset, sharded.MAX_ITEM_BYTES + 1)
    with open(folder / info.relative_path, "r+b") as shard:
        shard.truncate(info.offset + sharded.MAX_ITEM_BYTES + 1)
    raised = _bounded(lambda: sharded._check_plain_items(folder, index, "ckpt_path"))
    assert isinstance(raised, UserError) and "claims" in str(raised), raised


def test_a_shard_sets_files_are_regular_and_its_index_bounded(tmp_path: Path):
    """A shard set's manifest, index and shard, each replaced; and an index that gives each image 8 GB."""
    from hpctrain.data import shards

    def made(name: str) -> tuple[Path, list[dict[str, Any]]]:
        root = tmp_path / name
        (root / "train").mkdir(parents=True)
        np.savez(
            root / "train" / "shard-00000.npz",
            offsets=np.array([0, 4]),
            lengths=np.array([4, 4]),
            labels=np.array([0, 1]),
            names=np.array([b"a.png", b"b.png"]),
        )
        (root / "train" / "shard-00000.bin").write_bytes(b"\x00" * 8)
        entry = {"file": "train/shard-00000.bin", "index": "train/shard-00000.npz"}
        (root / shards.MANIFEST).write_text(json.dumps({"format": shards.FORMAT, "splits": {}}))
        return root, [entry]

    for name, replace in REPLACEMENTS.items():
        for file in (shards.MANIFEST, "train/shard-00000.npz", "train/shard-00000.bin"):
            if file.endswith(".bin") and replace is _oversized:
                continue  # a shard may be large: it is read by offset, as its bounded index says
            root, entries = made(f"{name.replace(' ', '_')}-{file.replace('/', '_')}")
            replace(root / file)
            read = (
                (lambda root=root: shards.read_manifest(root))
                if file == shards.MANIFEST
                else (lambda root=root, entries=entries: shards.ShardImages(root, entries, [1, 8, 8]))
            )
            what, value = _outcome(read)
            assert what == "raised" and isinstance(value, UserError), (name, file, repr(value))
    root, entries = made("claims")
    np.savez(
        root / "train" / "shard-00000.npz",
        offsets=np.array([0, 0]),
        lengths=np.array([8 << 30, 8 << 30]),
        labels=np.array([0, 1]),
        names=np.array([b"a.png", b"b.png"]),
    )
    raised = _bounded(lambda: shards.ShardImages(root, entries, [1, 8, 8]))
    assert isinstance(raised, UserError) and "more bytes than its shard holds" in str(raised), raised


# ------------------------------------------------------------------------------------ 4. staging


@pytest.mark.parametrize(
    "case", ["up and out", "absolute", "a link in the set", "a device", "a link in the copy"]
)
def test_staging_copies_only_the_sets_own_files(case: str, tmp_path: Path):
    from hpctrain.data.staging import stage

    source, stage_dir, outside = tmp_path / "set", tmp_path / "scratch", tmp_path / "outside"
    (source / "train").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"the user's own")
    (source / "train" / "a.bin").write_bytes(b"data")
    (source / "manifest.json").write_text("{}")
    names = {
        "up and out": "../outside/secret.bin",
        "absolute": str(outside / "secret.bin"),
        "a link in the set": "linked/secret.bin",
        "a device": "train/zero.bin",
        "a link in the copy": "train/a.bin",
    }
    if case == "a link in the set":
        (source / "linked").symlink_to(outside)
    if case == "a device":
        (source / "train" / "zero.bin").symlink_to("/dev/zero")
    if case == "a link in the copy":  # a copy left by an earlier attempt, its folder a link out
        from hpctrain.data.staging import private_folder

        own = private_folder(stage_dir)
        (own / "set").mkdir()
        (own / "set" / "train").symlink_to(outside)
    files = [(names[case], 4, "x")]
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(UserError, match=r"which is no file of the set itself|is not a regular file inside"):
        stage(source, stage_dir, files, "manifest.json")
    assert (
        sorted(p.name for p in outside.iterdir()) == before
        and (outside / "secret.bin").read_bytes() == b"the user's own"
    )
