"""Text that every machine has offline: the Python standard library's own source, as bytes.

The corpus is a fixed list of stdlib modules whose text has hardly changed across CPython 3.10-3.13,
each with the SHA-256 prefixes of the versions seen in CPython 3.10.13, 3.11.7, 3.12.1, 3.13.0 and
Debian 12's 3.11. A file that is missing, or whose checksum is none of those (a distribution patched
it, a release changed it), is skipped, and the log says which; if fewer than half of the files are
left, the data is refused with one sentence. So the corpus is the same text wherever its files match,
and close to it elsewhere.

Symbols are bytes (a 256-symbol vocabulary, no tokenizer). The concatenated text is split into
contiguous train/val/test ranges; a sample is a window of `block_size` bytes and the same window
shifted by one. Training windows start every `train_stride` bytes and are shuffled by the template's
sharded, resumable sampler (exact mid-epoch resume, every rank its share); evaluation windows do not
overlap and are read in order.

k-fold (`num_folds`, `fold`): the train and val ranges together are cut into `num_folds` contiguous
blocks of text; block `fold` is validated on, the others are trained on, and no window crosses into
the validation block. Contiguous, not shuffled: windows overlap, so a shuffled fold would hand the
validation text to training one byte shifted (hence no `fold_seed` here). The test range stays as it is.
"""

from __future__ import annotations

import hashlib
import logging
import sysconfig
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning import LightningDataModule
from torch import Tensor

from hpctrain import UserError
from hpctrain.data import (
    DataUnavailable,
    ResumableDataLoader,
    check_folds,
    make_loader,
    pin_memory_default,
    tensors_to_device,
)

log = logging.getLogger(__package__.split(".")[0])

# module -> accepted SHA-256 prefixes (16 hex digits)
STDLIB_FILES = {
    "difflib.py": ("0c6afc23568d55b3",),
    "optparse.py": ("07d224301cba312f",),
    "pickletools.py": ("1d43b5d94c640f5f", "bcc8d00ebadd684a"),
    "xml/dom/minidom.py": ("73ea6dd9d643638d", "af4ee09b06efc54e"),
    "xml/dom/expatbuilder.py": ("40ebc018d1f1d7f1", "80598dbc5970feaa"),
    "email/header.py": ("4d9baa908ad5288d", "99921e2aa7ae5ae1"),
    "heapq.py": ("0351667ed3afd331", "6d43277e5c76fc0f"),
    "concurrent/futures/_base.py": ("6fc621cca6d246a1", "8c6d5f09f7c535d4"),
    "weakref.py": ("56f8d313fb74019e", "dd8e03473ee5667c"),
    "email/headerregistry.py": ("c6732dcb9473c45c", "fada56c25b6a457c"),
    "tracemalloc.py": ("c2cc84a05b824df7",),
    "email/_parseaddr.py": ("4308932872acbf4a", "83c6229ce2dff4d1"),
    "xml/sax/handler.py": ("64c7aae49f1dd382",),
    "wsgiref/validate.py": ("4132f87dcf11a332", "622c6a2c69db3b10"),
    "_markupbase.py": ("cb14dd6f2e2439eb",),
    "json/__init__.py": ("d5d41e2c29049515",),
    "xml/etree/ElementPath.py": ("ae8a80a8b51567b4", "b98742c79365ce62"),
    "unittest/suite.py": ("ed2da92bc9f97c53",),
    "shlex.py": ("42ab6060f316e121", "f927227de5ba5b1b"),
    "lzma.py": ("58fb9d2fdc8a8af7", "6a923ba49b338971"),
    "xml/sax/xmlreader.py": ("0962c8d64ac8b031", "922a6e2995952366"),
    "json/decoder.py": ("0e756ee2194d865d", "9f02654649816145"),
    "xml/dom/xmlbuilder.py": ("d4f33a8f01875562",),
    "xml/sax/saxutils.py": ("3fe2cdb6386e0c4d",),
    "bz2.py": ("76ab3252924e71e8", "b217459e4c74ccb3"),
    "string.py": ("24aeae1f0526250f", "bc57c407a8397ee2"),
    "xml/dom/pulldom.py": ("614b88673d496a36", "99dd807c260c3bfa"),
    "queue.py": ("15d3d5e1acaa7cb3", "f6c37fc37cd74409"),
    "pyclbr.py": ("e8ca09333701ba41",),
    "numbers.py": ("6d70991643a109e9", "ac381960a3dc1db0"),
    "graphlib.py": ("7bd338c5a475d110", "c903f32178ae8205"),
    "urllib/robotparser.py": ("389b811835f9a3ba",),
    "shelve.py": ("6a10724762dea768", "b978c6f0ffa901b0"),
}


def stdlib_corpus(stdlib: str | Path | None = None) -> tuple[bytes, list[str], list[str]]:
    """The corpus text, the files used and the files skipped (missing or changed)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    parts, used, skipped = [], [], []
    for name, accepted in STDLIB_FILES.items():
        path = root / name
        try:
            content = path.read_bytes()
        except OSError:
            skipped.append(name)
            continue
        if hashlib.sha256(content).hexdigest()[:16] not in accepted:
            skipped.append(name)
            continue
        parts.append(content)
        used.append(name)
    return b"\n".join(parts), used, skipped


class Windows(torch.utils.data.Dataset):
    """Windows of `block_size` bytes of `text` starting at `starts`; indexing with a tensor of window
    numbers returns a whole batch (inputs, targets shifted by one) as int64 tensors."""

    def __init__(self, text: Tensor, starts: Tensor, block_size: int) -> None:
        self.text, self.starts, self.offsets = text, starts, torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: Tensor | int) -> tuple[Tensor, Tensor]:
        chunk = self.text[self.starts[index].unsqueeze(-1) + self.offsets].long()
        return chunk[..., :-1], chunk[..., 1:]


class StdlibTextDataModule(LightningDataModule):
    def __init__(
        self,
        block_size: int = 128,
        vocab_size: int = 256,
        batch_size: int = 32,
        train_stride: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 0,
        stdlib: str | None = None,
        num_folds: int | None = None,
        fold: int | None = None,
    ) -> None:
        super().__init__()
        self.num_folds, self.fold = check_folds(num_folds, fold), fold
        if vocab_size != 256:
            raise UserError(
                f"data.vocab_size={vocab_size} but the symbols are bytes; pass data.vocab_size=256."
            )
        self.block_size, self.vocab_size, self.batch_size = block_size, vocab_size, batch_size
        self.train_stride = train_stride or max(1, block_size // 2)
        self.fractions = (val_fraction, test_fraction)
        self.num_workers, self.pin_memory, self.seed, self.stdlib = num_workers, pin_memory, seed, stdlib
        self.splits: tuple[Windows, Windows, Windows] | None = None
        self._corpus: tuple[bytes, list[str], list[str]] | None = None

    def corpus(self) -> tuple[bytes, list[str], list[str]]:
        """stdlib_corpus(), read once: the preflight check and setup both need it."""
        if self._corpus is None:
            self._corpus = stdlib_corpus(self.stdlib)
        return self._corpus

    def check_available(self) -> None:
        _, used, _ = self.corpus()
        if len(used) < len(STDLIB_FILES) / 2:
            raise DataUnavailable(
                f"only {len(used)} of the {len(STDLIB_FILES)} standard-library files of the text corpus match "
                f"their recorded checksums in {self.stdlib or sysconfig.get_paths()['stdlib']} (this Python's "
                "files differ); run with a CPython 3.10-3.13 build, or point data.stdlib at one's lib/python3.X."
            )

    def setup(self, stage: str | None = None) -> None:
        if self.splits is not None:
            return
        raw, used, skipped = self.corpus()
        if skipped and self.trainer is not None and self.trainer.is_global_zero:
            log.info(
                "text corpus: %d stdlib files, %d skipped (missing or changed): %s",
                len(used),
                len(skipped),
                ", ".join(skipped),
            )
        text = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n = len(text)
        val, test = (int(n * f) for f in self.fractions)
        ranges = [[(0, n - val - test)], [(n - val - test, n - test)], [(n - test, n)]]
        if self.num_folds is not None:
            bounds = [round(i * (n - test) / self.num_folds) for i in range(self.num_folds + 1)]
            held = (bounds[self.fold], bounds[self.fold + 1])
            ranges[:2] = [[r for r in ((0, held[0]), (held[1], n - test)) if r[1] > r[0]], [held]]
        parts = []
        for index, pieces in enumerate(ranges):
            stride = self.train_stride if index == 0 else self.block_size
            name = ("train", "val", "test")[index]
            starts = [self._starts(start, end, stride, name) for start, end in pieces]
            parts.append(Windows(text, torch.cat(starts), self.block_size))
        self.splits = (parts[0], parts[1], parts[2])
        if self.num_folds is not None and (self.trainer is None or self.trainer.is_global_zero):
            log.info(
                "k-fold: fold %d of %d validates on bytes %d-%d of the %d training bytes (%d windows) and "
                "trains on the rest (%d windows); the test range is unchanged",
                self.fold,
                self.num_folds,
                *held,
                n - test,
                len(parts[1]),
                len(parts[0]),
            )

    def _starts(self, start: int, end: int, stride: int, name: str) -> Tensor:
        """Where the windows of the text's range [start, end) begin."""
        last = end - self.block_size - 1
        if last < start:
            fix = "smaller data.num_folds" if self.num_folds else "larger fractions"
            raise UserError(
                f"data.block_size={self.block_size} is longer than the text's {name} split ({end - start} "
                f"bytes); pass a smaller block_size or {fix}."
            )
        return torch.arange(start, last + 1, stride)

    def _loader(self, index: int) -> ResumableDataLoader:
        if self.splits is None:
            self.setup()
        assert self.splits is not None
        return make_loader(
            self.splits[index],
            self.batch_size,
            shuffle=index == 0,
            seed=self.seed,
            num_workers=self.num_workers,
            pin_memory=pin_memory_default(self.pin_memory, self.trainer),
            split=("train", "val", "test")[index],
        )

    def train_dataloader(self) -> ResumableDataLoader:
        return self._loader(0)

    def val_dataloader(self) -> ResumableDataLoader:
        return self._loader(1)

    def test_dataloader(self) -> ResumableDataLoader:
        return self._loader(2)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        moved = tensors_to_device(batch, device)
        return moved if moved is not None else super().transfer_batch_to_device(batch, device, dataloader_idx)
