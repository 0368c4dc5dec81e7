"""Download a dataset into paths.data_dir, on a machine with internet access.

    python scripts/prepare_data.py data=mnist
    python scripts/prepare_data.py data=fashion_mnist paths.data_dir=/shared/datasets

Then copy the directory to the cluster (or point paths.data_dir at a shared filesystem): compute
nodes are often offline, and training fails at once, naming this command, when the files are missing.
Works with any datamodule: it runs its `prepare_data()` and `setup("fit")` and counts the batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hpctrain.runtime.config.compose import compose
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.errors import reported_as_one_sentence


def main(overrides: list[str]) -> None:
    with reported_as_one_sentence():
        cfg = compose("train", overrides)
        from hpctrain.runtime.run import build

        datamodule = build.datamodule(cfg.data, Settings.of(cfg))
        datamodule.prepare_data()
        build.check_data_available(datamodule)
        datamodule.setup("fit")
        name = type(datamodule).__name__
        sizes = []
        for split in ("train", "val", "test"):
            if split == "test":
                datamodule.setup("test")
            loader = getattr(datamodule, f"{split}_dataloader")()
            dataset = getattr(loader, "dataset", None)
            count = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
            sizes.append(f"{count} {split}" if count is not None else f"{len(loader)} {split} batches")
        print(f"{name}: {', '.join(sizes)} samples ready in {cfg.paths.data_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
