"""Shards: a folder of images as a few large files per split, read by index (`data=shards`).

    <shards>/manifest.json                  classes, and per split its shards, sample counts, sizes, sha256
    <shards>/<split>/shard-00000.bin        the image files' bytes, one after another, as they were
    <shards>/<split>/shard-00000.npz        per image: offset and length in the .bin, label, original path

Why this format and not litdata or WebDataset: both are streams (IterableDataset) with their own
resume protocol, while the template's guarantee - a batch is a pure function of (seed, epoch, rank), and
a resumed run sees exactly the batches it would have seen, with any number of workers - comes from a
map-style dataset read with the template's sampler (`hpctrain.data.loading`). A shard here is read at
any index with one `pread`, so the same sampler, resume and DDP sharding hold unchanged, and the
images keep their original bytes: a shard set holds exactly the folder's images, byte for byte
(sha256 in the manifest, checked when shards are staged). `python scripts/make_shards.py` writes them.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data.decode import UnreadableImage, decode
from hpctrain.data.files import SPLITS, EncodedImages, FileImageDataModule, ImageFolderDataModule
from hpctrain.data.staging import stage
from hpctrain.runtime import confined
from hpctrain.runtime.errors import UserError

FORMAT = "hpctrain-shards/1"
MANIFEST = "manifest.json"
MAX_SAMPLE_BYTES = 1 << 28  # an encoded image of 256 MB: no image file a shard set holds is larger


def read_manifest(root: str | Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"data.root={root} holds no {MANIFEST}; make shards first: python scripts/make_shards.py "
            f"data=image_folder data.root=<image folder> --out {root}"
        )
    manifest = confined.read_json(path, "index", folder=root)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a shard manifest of this template ({FORMAT}); make the shards again.")
    return manifest


def write_shard(
    out: Path, split: str, number: int, root: Path, names: np.ndarray, labels: np.ndarray, check: Any
) -> dict[str, Any]:
    """Write one shard of `names` (paths relative to `root`) and return its manifest entry. `check(data,
    name)` is called on each file's bytes (decodes it; raises for a bad file, or returns False to skip it).

    Written under temporary names and renamed, the entry file last: an interrupted conversion leaves
    either a finished shard (reused when run again) or nothing that counts."""
    folder = out / split
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"shard-{number:05d}"
    entry_file = stem.with_suffix(".json")
    if entry_file.is_file():
        entry = json.loads(entry_file.read_text())
        if (out / entry["file"]).is_file() and (out / entry["file"]).stat().st_size == entry["bytes"]:
            return entry  # done by an earlier run of the converter
    digest = hashlib.sha256()
    offsets, lengths, kept, skipped = [], [], [], 0
    position = 0
    with open(f"{stem}.bin.tmp", "wb") as shard:
        for i, name in enumerate(names):
            with open(root / os.fsdecode(name), "rb") as file:
                data = file.read()
            if not check(data, os.fsdecode(name)):
                skipped += 1
                continue
            shard.write(data)
            digest.update(data)
            offsets.append(position)
            lengths.append(len(data))
            kept.append(i)
            position += len(data)
    with open(f"{stem}.npz.tmp", "wb") as index:
        np.savez(
            index,
            offsets=np.array(offsets, dtype=np.int64),
            lengths=np.array(lengths, dtype=np.int64),
            labels=labels[kept],
            names=names[kept],
        )
    os.replace(f"{stem}.bin.tmp", f"{stem}.bin")
    os.replace(f"{stem}.npz.tmp", f"{stem}.npz")
    entry = shard_entry(stem, len(kept), skipped, position, digest.hexdigest())
    tmp = entry_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, entry_file)
    return entry


def shard_entry(stem: Path, samples: int, skipped: int, size: int, sha256: str) -> dict[str, Any]:
    """A shard's manifest entry, once `<stem>.bin` and its index `<stem>.npz` are written."""
    split = stem.parent.name
    index = Path(f"{stem}.npz")
    return {
        "file": f"{split}/{stem.name}.bin",
        "index": f"{split}/{index.name}",
        "samples": samples,
        "skipped": skipped,
        "bytes": size,
        "sha256": sha256,
        "index_bytes": index.stat().st_size,
        "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
    }


def write_manifest(
    out: Path, classes: Sequence[str], splits: dict[str, list[dict[str, Any]]], source: str, **more: Any
) -> None:
    """The manifest, last: the shards' entries by split, and `more` (a token set's `kind` and `tokens`)."""
    manifest = {
        "format": FORMAT,
        "source": source,
        "classes": list(classes),
        "splits": {
            split: {"samples": sum(e["samples"] for e in entries), "shards": entries}
            for split, entries in splits.items()
        },
        **more,
    }
    tmp = out / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)


def manifest_files(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """Every file a shard set holds but the manifest: (relative path, size, sha256)."""
    files = []
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            files.append((entry["file"], entry["bytes"], entry["sha256"]))
            files.append((entry["index"], entry["index_bytes"], entry["index_sha256"]))
    return files


def decodes(data: bytes, name: str, image_shape: Sequence[int], skip_bad: bool) -> bool:
    """Whether a file decodes as training will decode it; a bad file is one sentence, or (skip_bad) False."""
    try:
        decode(io.BytesIO(data), image_shape)
    except UnreadableImage as err:
        if skip_bad:
            return False
        raise UserError(
            f"{name} cannot be read as an image ({err}); remove or replace it, or pass data.skip_bad=true to "
            "leave such files out of the shards."
        ) from err
    return True


def make_shards(
    folder: ImageFolderDataModule,
    out: Path,
    shard_mb: float = 256.0,
    workers: int = 1,
    advance: Callable[[int, int], Any] = lambda done, total: None,
) -> dict[str, list[dict[str, Any]]]:
    """Write the shards of an image folder's splits into `out` (in the order the folder is read, about
    `shard_mb` MB each, `workers` processes) and their manifest last; returns the manifest's entries.
    An `out` holding a finished shard set is refused; shards an interrupted run finished are kept."""
    if (out / MANIFEST).exists():
        raise UserError(f"--out {out} already holds shards ({MANIFEST}); remove it or choose another --out.")
    parts = folder.load()  # the file lists, checked as training checks them
    check = partial(decodes, image_shape=folder.image_shape, skip_bad=folder.skip_bad)
    jobs = []
    for split, part in zip(SPLITS, parts, strict=True):
        if not len(part):
            continue
        total = sum(os.stat(os.path.join(part.root, n)).st_size for n in part.names)
        count = max(1, math.ceil(total / (shard_mb * 1e6)))
        bounds = [round(i * len(part) / count) for i in range(count + 1)]
        for number in range(count):
            chunk = slice(bounds[number], bounds[number + 1])
            jobs.append((split, number, part.names[chunk], part.labels.numpy()[chunk]))
    entries: dict[str, list[dict[str, Any]]] = {split: [] for split, *_ in jobs}
    root = Path(os.fsdecode(parts[0].root))
    if workers == 1:  # in this process: no pool to start
        for done, (split, number, names, labels) in enumerate(jobs, 1):
            entries[split].append(write_shard(out, split, number, root, names, labels, check))
            advance(done, len(jobs))
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [
                (split, pool.submit(write_shard, out, split, n, root, names, labels, check))
                for split, n, names, labels in jobs
            ]
            for done, (split, future) in enumerate(futures, 1):
                entries[split].append(future.result())
                advance(done, len(futures))
    write_manifest(out, folder.classes, entries, source=str(root))
    return entries


class ShardImages(EncodedImages):
    """One split of a shard set: image i is `length[i]` bytes at `offset[i]` of shard `shard[i]`."""

    def __init__(self, root: Path, entries: Sequence[dict[str, Any]], image_shape: Sequence[int]) -> None:
        indexes = []
        for entry in entries:  # a shard set's own files: inside it, regular, bounded
            data = confined.read_bytes(root / entry["index"], "index", folder=root)
            with np.load(io.BytesIO(data), allow_pickle=False) as index:
                indexes.append({k: index[k] for k in ("offsets", "lengths", "labels", "names")})
            shard = confined.regular_file(root / entry["file"], folder=root)
            found = indexes[-1]
            if len(found["lengths"]) and (
                found["lengths"].max() > MAX_SAMPLE_BYTES
                or (found["offsets"] + found["lengths"]).max() > shard.stat().st_size
            ):
                raise UserError(
                    f"{root / entry['index']} gives its images more bytes than its shard holds, or more than an "
                    f"image ever takes ({MAX_SAMPLE_BYTES}); make the shards again with scripts/make_shards.py."
                )
        joined = {
            k: np.concatenate([i[k] for i in indexes]) if indexes else np.array([])
            for k in ("offsets", "lengths", "labels", "names")
        }
        super().__init__(joined["names"], joined["labels"].astype(np.int64), image_shape)
        self.files = [os.fsencode(root / entry["file"]) for entry in entries]
        self.shard = np.repeat(np.arange(len(entries), dtype=np.int32), [len(i["labels"]) for i in indexes])
        self.offsets = joined["offsets"].astype(np.int64)
        self.lengths = joined["lengths"].astype(np.int64)
        self._fds: dict[int, int] = {}

    def read(self, index: int) -> bytes:
        shard = int(self.shard[index])
        fd = self._fds.get(shard)
        if (
            fd is None
        ):  # opened on first use in each process (a forked worker may use its parent's: pread has no position)
            fd = self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
        return os.pread(fd, int(self.lengths[index]), int(self.offsets[index]))

    per_sample = ("names", "shard", "offsets", "lengths")

    def _copy(self) -> ShardImages:
        copy = super()._copy()
        copy._fds = {}  # type: ignore[attr-defined]  # its own, opened on first use
        return copy  # type: ignore[return-value]

    def joined(self, other: EncodedImages) -> EncodedImages:
        if not isinstance(other, ShardImages):
            raise ValueError("only splits of shard sets can be joined")
        renumbered = other._copy()
        renumbered.shard = other.shard + len(self.files)  # other's shards come after this one's
        copy = super().joined(renumbered)
        copy.files = [*self.files, *other.files]  # type: ignore[attr-defined]
        return copy

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}  # a spawned worker opens its own


class ShardsDataModule(FileImageDataModule):
    """Shards written by scripts/make_shards.py, optionally staged to node-local scratch first
    (`stage_dir`, `hpctrain.data.staging`): local copies, checked against the manifest's sha256."""

    can_stage = True

    def __init__(self, root: str, num_classes: int, image_shape: Sequence[int], **kwargs: Any) -> None:
        super().__init__(num_classes=num_classes, image_shape=image_shape, **kwargs)
        self.root = Path(root)
        self.classes: list[str] = []
        self._manifest: dict[str, Any] | None = None
        self._staged = False

    @property
    def has_test(self) -> bool:
        return bool(self._read()["splits"].get("test", {}).get("samples"))

    def _read(self) -> dict[str, Any]:
        if self._manifest is None:
            self._manifest = read_manifest(self.root)
        return self._manifest

    def check_available(self) -> None:
        """The manifest checked, and with `stage_dir` the node-local copy made (before any process group:
        a copy of hours must not run into a collective's timeout)."""
        manifest = self._read()
        self.classes = list(manifest["classes"])
        if len(self.classes) != self.num_classes:
            raise UserError(
                f"data.num_classes={self.num_classes} but the shards in {self.root} have {len(self.classes)} "
                f"classes; pass data.num_classes={len(self.classes)}."
            )
        for split in ("train", "val"):
            if not manifest["splits"].get(split, {}).get("samples"):
                raise UserError(
                    f"the shards in {self.root} have no {split} split; make them from a folder with {split}/."
                )
        if self.stage_dir and not self._staged:
            self.root = stage(self.root, Path(self.stage_dir), manifest_files(manifest), MANIFEST)
            self._manifest, self._staged = None, True

    def load(self) -> tuple[ShardImages, ...]:
        self.check_available()
        manifest = self._read()
        return tuple(
            ShardImages(self.root, manifest["splits"].get(split, {}).get("shards", []), self.image_shape)
            for split in SPLITS
        )
