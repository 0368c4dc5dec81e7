"""Data at scale, side by side in one run: an image folder and its shards against a plain loader.

    python scripts/dev/data_benchmark.py                  # 100 MB and 1 GB of JPEGs, 2 loader workers
    python scripts/dev/data_benchmark.py --sizes-mb 200 2000 --workers 4

Writes JPEG files (224x224 RGB, smooth random content, 10 classes) of two total sizes, makes shards of
each (scripts/make_shards.py's writer) and measures, with the same number of loader workers and batch size:

  plain      a torch DataLoader over a Dataset of paths that only opens, decodes (Pillow), resizes and
             batches them (default collate): the floor any image-folder loader pays
  folder     the template's data=image_folder loader (its sampler, decoding into one uint8 batch)
  shards     the template's data=shards loader over the same images
  staging    data.stage_dir's copy (sha256 checked while copying) against `cp -r` of the same shards
  memory     peak anonymous memory (Pss_Anon: not the page cache, shared pages once) of a loading
             process plus its workers, per size

A figure is the median, over rounds taken in turn, of images per second over the batches after the
first; time to first batch counts from building the loader (listing the folder, or reading the
manifest) to its first batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

SIDE = 224
SHAPE = (3, 64, 64)
CLASSES = 10


def write_jpegs(root: Path, megabytes: float, seed: int = 0) -> int:
    """JPEG files of about `megabytes` in total under root/train/<class>/ (and a small val/)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    written = count = 0
    while written < megabytes * 1e6:
        small = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((SIDE, SIDE), Image.Resampling.BICUBIC)
        split = "val" if count % 20 == 19 else "train"
        folder = root / split / f"class{count % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{count:07d}.jpg"
        image.save(path, quality=90)
        written += path.stat().st_size
        count += 1
    return count


def make_shards(folder: Path, out: Path, workers: int) -> None:
    """What scripts/make_shards.py does, in this process (hpctrain.data.shards.make_shards)."""
    from hpctrain.data import shards
    from hpctrain.data.files import ImageFolderDataModule

    images = ImageFolderDataModule(root=str(folder), num_classes=CLASSES, image_shape=SHAPE)
    images.check_available()
    shards.make_shards(images, out, shard_mb=64, workers=workers)


class PlainFiles:
    """The floor: a path per sample, decoded one at a time, batched by the default collate."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(str(p) for p in (folder / "train").rglob("*.jpg"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import numpy as np
        import torch
        from PIL import Image

        with Image.open(self.files[i]) as image:
            pixels = np.asarray(image.convert("RGB").resize(SHAPE[:0:-1], Image.Resampling.BILINEAR))
        return torch.from_numpy(pixels.copy()).permute(2, 0, 1), 0


def _datamodule(kind: str, root: Path, workers: int, batch_size: int):
    from hpctrain.data.files import ImageFolderDataModule
    from hpctrain.data.shards import ShardsDataModule

    cls = ImageFolderDataModule if kind == "folder" else ShardsDataModule
    return cls(
        root=str(root), num_classes=CLASSES, image_shape=SHAPE, batch_size=batch_size, num_workers=workers
    )


def loader(kind: str, root: Path, workers: int, batch_size: int):
    if kind == "plain":
        import torch
        from torch.utils.data import DataLoader

        return DataLoader(
            PlainFiles(root),
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )
    data = _datamodule(kind, root, workers, batch_size)
    data.setup("fit")
    return data.train_dataloader()


class PeakAnonymousRss:
    """Samples the anonymous memory of this process and its children (loader workers) every 100 ms:
    the sum of their proportional shares (Pss_Anon), so pages a forked worker shares with its parent
    are counted once, and the page cache (file pages) not at all."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _anon_kb(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _family(self) -> list[int]:
        me = os.getpid()
        children = Path(f"/proc/{me}/task/{me}/children")
        kids = [int(p) for p in children.read_text().split()] if children.exists() else []
        return [me, *kids]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, sum(self._anon_kb(p) for p in self._family()))
            time.sleep(0.1)

    def __enter__(self) -> PeakAnonymousRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def first_batch(kind: str, root: Path, workers: int, batch_size: int) -> float:
    """Seconds from building the loader (listing the folder, or reading the manifest) to its first batch."""
    started = time.perf_counter()
    next(iter(loader(kind, root, workers, batch_size)))
    return time.perf_counter() - started


def read_rate(kind: str, root: Path, workers: int, batch_size: int, batches: int) -> tuple[float, float]:
    """Images per second over `batches` batches after the first, and the peak anonymous memory (MB)."""
    with PeakAnonymousRss() as rss:
        iterator = iter(loader(kind, root, workers, batch_size))
        next(iterator)
        counted, started = 0, time.perf_counter()
        for images, _ in iterator:
            counted += len(images)
            if counted >= batches * batch_size:
                break
        rate = counted / (time.perf_counter() - started)
        del iterator
    return rate, rss.peak_kb / 1024


def staging_rate(shards: Path, scratch: Path) -> dict[str, float]:
    from hpctrain.data import staging
    from hpctrain.data.shards import MANIFEST, manifest_files, read_manifest

    size = sum(p.stat().st_size for p in shards.rglob("*") if p.is_file()) / 1e9
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(shards), str(scratch / "cp")], check=True)
    cp_s = time.perf_counter() - started
    started = time.perf_counter()
    staging.stage(shards, scratch / "stage", manifest_files(read_manifest(shards)), MANIFEST)
    stage_s = time.perf_counter() - started
    return {"gb": size, "cp_s_per_gb": cp_s / size, "stage_s_per_gb": stage_s / size}


def run(
    sizes_mb: list[float], workers: int, batch_size: int, batches: int, rounds: int, keep: Path | None = None
) -> dict:
    import torch.utils.data  # noqa: F401  (imported before any timing: not part of a first batch)

    import hpctrain.data.shards  # noqa: F401

    work = Path(keep or tempfile.mkdtemp(prefix="data-bench-"))
    report: dict = {
        "workers": workers,
        "batch_size": batch_size,
        "rounds": rounds,
        "image": f"{SIDE}x{SIDE} JPEG -> {SHAPE}",
        "sizes": [],
    }
    try:
        for megabytes in sizes_mb:
            folder, shards = work / f"folder-{megabytes:g}", work / f"shards-{megabytes:g}"
            if not folder.is_dir():  # --keep: made once, measured again
                write_jpegs(folder, megabytes)
            if not (shards / "manifest.json").is_file():
                make_shards(folder, shards, workers=max(1, workers))
            count = sum(1 for _ in (folder / "train").rglob("*.jpg"))
            row: dict = {"megabytes": megabytes, "train_images": count}
            roots = {"plain": folder, "folder": folder, "shards": shards}
            rates: dict[str, list[float]] = {kind: [] for kind in roots}
            memory: dict[str, float] = dict.fromkeys(roots, 0.0)
            for _ in range(rounds):  # in turn, round after round: a busy moment slows all three alike
                for kind, root in roots.items():
                    rate, peak = read_rate(kind, root, workers, batch_size, batches)
                    rates[kind].append(rate)
                    memory[kind] = max(memory[kind], peak)
            for kind, root in roots.items():
                row[kind] = {
                    "images_per_s": statistics.median(rates[kind]),
                    "first_batch_s": first_batch(kind, root, workers, batch_size),
                    "peak_anon_mb": memory[kind],
                }
            row["folder_over_plain"] = row["folder"]["images_per_s"] / row["plain"]["images_per_s"]
            row["shards_over_plain"] = row["shards"]["images_per_s"] / row["plain"]["images_per_s"]
            row["shards_over_folder"] = row["shards"]["images_per_s"] / row["folder"]["images_per_s"]
            scratch = work / f"scratch-{megabytes:g}"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            row["staging"] = staging_rate(shards, scratch)
            report["sizes"].append(row)
            print_row(row, workers, batch_size)
            shutil.rmtree(scratch)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return report


def print_row(row: dict, workers: int, batch_size: int) -> None:
    print(
        f"data at scale, {row['megabytes']:g} MB ({row['train_images']} training JPEGs), {workers} workers, batch {batch_size}:",
        flush=True,
    )
    for kind in ("plain", "folder", "shards"):
        r = row[kind]
        print(
            f"  {kind:7s} {r['images_per_s']:8.0f} images/s   first batch {r['first_batch_s']:.2f} s   "
            f"peak anonymous memory {r['peak_anon_mb']:.0f} MB (process + workers)",
            flush=True,
        )
    s = row["staging"]
    print(
        f"  folder/plain {row['folder_over_plain']:.2f}x, shards/plain {row['shards_over_plain']:.2f}x, "
        f"shards/folder {row['shards_over_folder']:.2f}x; staging {s['stage_s_per_gb']:.2f} s/GB "
        f"(sha256 checked) vs cp -r {s['cp_s_per_gb']:.2f} s/GB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[100, 1000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=100, help="batches timed per loader and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of plain, folder and shards (median)")
    parser.add_argument(
        "--keep", type=Path, help="make the images and shards here, and reuse them when run again"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = run(args.sizes_mb, args.workers, args.batch_size, args.batches, args.rounds, args.keep)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
