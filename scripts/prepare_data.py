"""Download a dataset into paths.data_dir, on a machine with internet access.

    python scripts/prepare_data.py data=mnist
    python scripts/prepare_data.py data=fashion_mnist paths.data_dir=/shared/datasets

Then copy the directory to the cluster (or point paths.data_dir at a shared filesystem): compute
nodes are often offline, and training fails at once, naming this command, when the files are missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from hpctrain.errors import reported_as_one_sentence  # noqa: E402
from hpctrain.resolvers import register_resolvers  # noqa: E402


def main(overrides: list[str]) -> None:
    register_resolvers(ROOT)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with reported_as_one_sentence():
        datamodule = instantiate(cfg.data)
        datamodule.prepare_data()
        datamodule.setup()
        train, val, test = datamodule.splits
        print(
            f"{cfg.data._target_.rsplit('.', 1)[-1]}: {len(train)} train, {len(val)} val, {len(test)} test samples ready"
        )
        if hasattr(datamodule, "raw_dir"):
            print(f"files in {datamodule.raw_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
