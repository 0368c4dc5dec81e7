"""Tokenized text as shards: tokenized once, keyed by what decides the tokens, staged per node, resumable.

    <cache_dir>/<name>-<digest>/manifest.json             the template's shard manifest (kind: tokens)
    <cache_dir>/<name>-<digest>/<split>/shard-00000.bin   per example: input ids, labels, positions (int32)
    <cache_dir>/<name>-<digest>/<split>/shard-00000.npz   per example: offset and length in the .bin

`TokenizedDataModule` is the base of a datamodule whose samples are token sequences (instruction tuning,
plain text). A subclass says which files the tokens come from (`sources`: the data, the tokenizer's
files), which settings decide them (`settings`) and how to make them (`tokenize`); the digest of all
three names the shard set. So:
- the first process of the job to get there tokenizes, once, into a temporary folder renamed into place;
  every other process, on this node or another, waits for it (the data check runs before any process
  group: tokenizing for an hour must not run into a collective's timeout), and a second run with the same
  data, tokenizer and settings tokenizes nothing;
- with `stage_dir` (node-local scratch), the shards are copied there once per node with their sha256
  checked (`hpctrain.data.staging`); the node's other ranks wait for that one copy;
- an example is read at any index (memory-mapped), so the template's sampler shards the batches across
  ranks and resumes mid-epoch exactly (`hpctrain.data.loading`);
- a batch is padded to its longest example: `input_ids`, `labels` (-100 where no loss is taken: padding,
  and what the subclass masked, e.g. the prompt), `position_ids` (they restart at 0 where a packed example
  starts: a model keeps attention inside each example from them) and `attention_mask` (1 for tokens).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hpctrain.data.loading import ResumableDataLoader, make_loader, pin_memory_default
from hpctrain.data.shards import MANIFEST, manifest_files, read_manifest, shard_entry, write_manifest
from hpctrain.data.staging import once, stage
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import LightningPart

log = logging.getLogger("hpctrain")
IGNORE = -100  # the label of a token no loss is taken on (torch's cross_entropy ignore_index)
SHARD_TOKENS = 1 << 26  # about 256 MB of int32 per shard file
LARGE_FILE = 64 << 20  # larger source files are keyed by size, time and their first and last MiB

Example = tuple[Sequence[int], Sequence[int], Sequence[int]]  # input ids, labels, positions


class TokenExamples(torch.utils.data.Dataset):
    """One split of a token shard set; indexing with a tensor of example numbers returns a padded batch."""

    def __init__(self, root: Path, entries: Sequence[dict[str, Any]], pad_id: int) -> None:
        self.pad_id = pad_id
        self.files = [root / entry["file"] for entry in entries]
        offsets, lengths, shard = [], [], []
        for number, entry in enumerate(entries):
            with np.load(root / entry["index"], allow_pickle=False) as index:
                offsets.append(index["offsets"])
                lengths.append(index["lengths"])
            shard.append(np.full(len(lengths[-1]), number, dtype=np.int32))
        self.offsets = np.concatenate(offsets) if offsets else np.zeros(0, np.int64)
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.shard = np.concatenate(shard) if shard else np.zeros(0, np.int32)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shard = int(self.shard[index])
        data = self._maps.get(shard)
        if data is None:  # mapped on first use in each process (a worker maps its own)
            data = self._maps[shard] = np.memmap(self.files[shard], dtype=np.int32, mode="r")
        start, n = int(self.offsets[index]), int(self.lengths[index])
        record = data[start : start + 3 * n]
        return record[:n], record[n : 2 * n], record[2 * n :]

    def __getitem__(self, index: Tensor | int) -> dict[str, Tensor]:
        numbers = [int(index)] if not isinstance(index, Tensor) or index.dim() == 0 else index.tolist()
        examples = [self.example(i) for i in numbers]
        width = max(len(ids) for ids, _, _ in examples)
        padding = {"input_ids": self.pad_id, "labels": IGNORE, "position_ids": 0, "attention_mask": 0}
        batch = {k: torch.full((len(examples), width), v, dtype=torch.int64) for k, v in padding.items()}
        for row, example in enumerate(examples):
            n = len(example[0])
            for key, values in zip(("input_ids", "labels", "position_ids"), example, strict=True):
                batch[key][row, :n] = torch.from_numpy(values.astype(np.int64))
            batch["attention_mask"][row, :n] = 1
        return batch

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # a spawned worker maps its own


def write_tokens(out: Path, splits: dict[str, Iterable[Example]], source: str, about: dict[str, Any]) -> None:
    """The shards of each split's examples in `out` (about `SHARD_TOKENS` tokens a file), then the manifest."""
    entries: dict[str, list[dict[str, Any]]] = {}
    for split, examples in splits.items():
        entries[split] = []
        pending: list[np.ndarray] = []
        lengths: list[int] = []
        size = 0
        for ids, labels, positions in examples:
            if not (len(ids) == len(labels) == len(positions)) or not len(ids):
                raise ValueError(
                    f"an example of {split} has {len(ids)} ids, {len(labels)} labels, {len(positions)} positions"
                )
            pending.append(np.asarray([*ids, *labels, *positions], dtype=np.int32))
            lengths.append(len(ids))
            size += 3 * len(ids)
            if size >= SHARD_TOKENS:
                entries[split].append(_write_shard(out, split, len(entries[split]), pending, lengths))
                pending, lengths, size = [], [], 0
        if pending or not entries[split]:
            entries[split].append(_write_shard(out, split, len(entries[split]), pending, lengths))
    write_manifest(out, [], entries, source, kind="tokens", tokens=about)


def _write_shard(
    out: Path, split: str, number: int, records: list[np.ndarray], lengths: list[int]
) -> dict[str, Any]:
    folder = out / split
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"shard-{number:05d}"
    data = np.concatenate(records) if records else np.zeros(0, np.int32)
    data.tofile(f"{stem}.bin")
    sizes = np.asarray([3 * n for n in lengths], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else sizes
    with open(f"{stem}.npz", "wb") as index:
        np.savez(index, offsets=offsets, lengths=np.asarray(lengths, dtype=np.int64))
    return shard_entry(stem, len(lengths), 0, data.nbytes, hashlib.sha256(data.tobytes()).hexdigest())


def source_digest(sources: Sequence[Path], settings: dict[str, Any]) -> str:
    """What decides the tokens: each source file's content (a large one: its size, modification time and
    first and last MiB) and the settings."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for path in sources:
        digest.update(path.name.encode())
        size = path.stat().st_size
        with open(path, "rb") as file:
            if size <= LARGE_FILE:
                digest.update(file.read())
            else:
                digest.update(f"{size} {path.stat().st_mtime_ns}".encode())
                digest.update(file.read(1 << 20))
                file.seek(-(1 << 20), os.SEEK_END)
                digest.update(file.read())
    return digest.hexdigest()[:16]


def made_once(target: Path, make: Any, marker: str = MANIFEST) -> bool:
    """`target` (a folder holding `marker` once complete) made by the first process of the job to get here,
    on any node (a shared filesystem), `make(tmp)` writing into a temporary folder renamed into place; the
    others wait for it. Whether this process made it."""

    def make_in_place() -> None:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            make(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(f".{target.name}.lock")
    return once(lock, (target / marker).is_file, make_in_place, f"write {target}")


class TokenizedDataModule(LightningPart, lightning="pytorch_lightning.LightningDataModule"):
    """Token sequences, tokenized once into shards and read as the module docstring says. Subclasses
    implement `sources()`, `settings()`, `tokenize()` ({split: examples}; train and val) and `pad_id`.

    A LightningDataModule of the Lightning package the run's model is written with (`import lightning as L`
    or `import pytorch_lightning as pl`), made so when constructed (`hpctrain.runtime.namespaces`); outside
    a run, pytorch_lightning's."""

    can_stage = True
    name = "tokens"

    def __init__(
        self,
        cache_dir: str,
        batch_size: int = 8,
        stage_dir: str | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.cache_dir = Path(cache_dir).expanduser()
        self.batch_size, self.stage_dir = batch_size, stage_dir or None
        self.num_workers, self.pin_memory, self.seed = num_workers, pin_memory, seed
        self.root: Path | None = None
        self.tokenized_now = False  # whether this process tokenized (a second run: never)
        self.splits: dict[str, TokenExamples] = {}

    # what a subclass says
    def sources(self) -> list[Path]:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def tokenize(self) -> dict[str, Iterator[Example]]:
        raise NotImplementedError

    @property
    def pad_id(self) -> int:
        raise NotImplementedError

    def check_available(self) -> None:
        """Tokenized (once, by one process) and, with `stage_dir`, staged to this node (once per node);
        before any process group."""
        if self.root is not None:
            return
        sources = self.sources()
        key = source_digest(sources, self.settings())
        folder = self.cache_dir / f"{self.name}-{key}"
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(
                f"data.cache_dir={self.cache_dir} cannot be made ({err.strerror or err}); pass a data.cache_dir "
                "you can write (a shared filesystem every node reads)."
            ) from err
        started = time.monotonic()
        self.tokenized_now = made_once(folder, self._write)
        if self.tokenized_now:
            log.info(
                "tokenized %s into %s in %.1f s",
                ", ".join(map(str, sources)),
                folder,
                time.monotonic() - started,
            )
        manifest = read_manifest(folder)
        self.root = folder
        if self.stage_dir:
            self.root = stage(folder, Path(self.stage_dir), manifest_files(manifest), MANIFEST)

    def _write(self, out: Path) -> None:
        about = {"settings": self.settings(), "sources": [str(p) for p in self.sources()]}
        write_tokens(out, self.tokenize(), ", ".join(map(str, self.sources())), about)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.check_available()
        assert self.root is not None
        manifest = read_manifest(self.root)
        self.splits = {
            split: TokenExamples(self.root, entry["shards"], self.pad_id)
            for split, entry in manifest["splits"].items()
        }

    def _loader(self, split: str) -> ResumableDataLoader:
        self.setup()
        return make_loader(
            self.splits[split],
            self.batch_size,
            shuffle=split == "train",
            seed=self.seed,
            num_workers=self.num_workers,
            pin_memory=pin_memory_default(self.pin_memory, self.trainer),
            split=split,
        )

    def train_dataloader(self) -> ResumableDataLoader:
        return self._loader("train")

    def val_dataloader(self) -> ResumableDataLoader:
        return self._loader("val")

    @property
    def has_test(self) -> bool:
        return False
