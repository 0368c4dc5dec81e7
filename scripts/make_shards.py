"""Turn an image folder into shards: a few large files per split instead of millions of small ones.

    python scripts/make_shards.py data=image_folder data.root=/datasets/pets --out /datasets/pets-shards
    python src/train.py data=shards data.root=/datasets/pets-shards data.num_classes=37 ...

Each image keeps its bytes (the shards hold exactly the folder's files, in the order the image_folder
datamodule reads them, sha256 in the manifest) and is decoded once here, so a bad file is found now:
one sentence naming it, or with data.skip_bad=true skipped and counted in the manifest. Parallel over
the CPUs (--workers), with a progress bar; interrupted, it continues where it stopped when run again
(finished shards are kept). An --out that already holds a finished shard set is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.errors import UserError, reported_as_one_sentence


def convert(overrides: list[str], out: Path | None, shard_mb: float, workers: int) -> Path:
    from rich.progress import Progress

    from hpctrain.data import shards
    from hpctrain.data.files import ImageFolderDataModule
    from hpctrain.runtime.run import build

    cfg = compose("train", overrides)
    datamodule = build.datamodule(cfg.data, Settings.of(cfg))
    if not isinstance(datamodule, ImageFolderDataModule):
        raise UserError(
            f"make_shards reads an image folder: pass data=image_folder data.root=<folder>, not data={cfg.data._target_}."
        )
    root = datamodule.root.resolve()
    out = (out or root.with_name(root.name + "-shards")).resolve()
    with Progress() as progress:
        task = progress.add_task(f"shards of {root}", total=None)
        entries = shards.make_shards(
            datamodule,
            out,
            shard_mb,
            workers,
            advance=lambda done, total: progress.update(task, completed=done, total=total),
        )
    for split, found in entries.items():
        skipped = sum(e["skipped"] for e in found)
        print(
            f"{split}: {sum(e['samples'] for e in found)} images in {len(found)} shards"
            + (f", {skipped} skipped (unreadable)" if skipped else "")
        )
    if datamodule.skipped_files:
        print(f"{datamodule.skipped_files} files that are not images were left out (data.skip_bad=true)")
    shape = ",".join(map(str, datamodule.image_shape))
    print(
        f"shards in {out}: python src/train.py data=shards data.root={out} data.num_classes={len(datamodule.classes)} data.image_shape=[{shape}]"
    )
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="%(prog)s [overrides ...] [--out DIR]"
    )
    parser.add_argument(
        "--out", type=Path, help="where the shards go (default: <data.root>-shards beside the folder)"
    )
    parser.add_argument(
        "--shard-mb", type=float, default=256.0, help="about this many MB per shard (default 256)"
    )
    parser.add_argument(
        "--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes (default: the CPUs)"
    )
    args, overrides = parser.parse_known_args(argv)
    with reported_as_one_sentence():
        convert(overrides, args.out, args.shard_mb, max(1, args.workers))


if __name__ == "__main__":
    main(sys.argv[1:])
