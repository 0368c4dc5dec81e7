"""Files written as an attacker would write them, for the trust tests: each tries to run code that leaves a
marker file behind, so a test can tell that nothing ran (the marker is absent), not only that an error came."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hpctrain.runtime.run.checkpoints.reading import CONFIG_KEY


def _shell(marker: Path) -> bytes:
    return f"touch {marker}".encode()


def folder_index(folder: Path, marker: Path) -> Path:
    """A checkpoint folder whose index (.metadata) reaches os.system through a module DCP owns: pickle
    resolves the dotted name `os.system` attribute by attribute from torch.distributed.checkpoint.filesystem."""
    folder.mkdir(parents=True, exist_ok=True)
    command = _shell(marker)
    payload = (
        b"\x80\x04"
        + b"ctorch.distributed.checkpoint.filesystem\nos.system\n"
        + b"X"
        + len(command).to_bytes(4, "little")
        + command
        + b"\x85R."
    )
    (folder / ".metadata").write_bytes(payload)
    return folder


def classic_pickle(path: Path, marker: Path) -> Path:
    """A .ckpt whose pickle calls os.system when loaded without weights_only."""

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    torch.save({"state_dict": {}, "callbacks": Payload()}, path)
    return path


def hub_repo(folder: Path, marker: Path) -> Path:
    """A folder torch.hub.load(source='local') would run: its hubconf.py leaves the marker."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hubconf.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\ndef model(**kwargs):\n    return None\n"
    )
    return folder


def hub_target(repo: Path) -> dict[str, str]:
    """A stored config node that passes Hydra 1.3's blocklist and runs the repo's code."""
    return {"_target_": "torch.hub.load", "repo_or_dir": str(repo), "model": "model", "source": "local"}


def stored_config_checkpoint(path: Path, repo: Path, nested: bool = False) -> Path:
    """A .ckpt that loads with weights_only=True and whose stored model config names torch.hub.load (at the
    top, or `nested` as the network of this project's own classifier)."""
    model = (
        {
            "_target_": "myproject.models.classifier.ImageClassifier",
            "net": hub_target(repo),
            "num_classes": 10,
        }
        if nested
        else hub_target(repo)
    )
    data = {"_target_": "myproject.data.digits.DigitsDataModule", "batch_size": 8}
    torch.save(
        {"state_dict": {}, "epoch": 0, "global_step": 0, CONFIG_KEY: {"model": model, "data": data}}, path
    )
    return path


def safetensors_file(path: Path, repo: Path) -> Path:
    """A .safetensors file of a weight or two whose metadata's config names torch.hub.load."""
    from safetensors.torch import save_file

    config = {"model": hub_target(repo), "data": {}}
    save_file({"net.weight": torch.zeros(2, 2)}, str(path), metadata={"config": json.dumps(config)})
    return path


def index_folder(folder: Path, relative_path: str, shard_bytes: int = 8, elements: int = 2) -> Path:
    """A checkpoint folder whose (well-formed) index names one shard at `relative_path`, holding one tensor
    of `elements` float32 values in `shard_bytes` bytes."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir(parents=True)
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([elements]))
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([elements]), [chunk])
    index = Metadata(state_dict_metadata={"state_dict.w": meta})
    index.storage_data = {
        MetadataIndex("state_dict.w", torch.Size([0])): _StorageInfo(relative_path, 0, shard_bytes)
    }
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    return folder


def shell_pickle(marker: Path) -> bytes:
    """A pickle that runs `touch <marker>` when loaded by plain `pickle.load` (os.system, by its own name)."""
    command = _shell(marker)
    return b"\x80\x04cos\nsystem\nX" + len(command).to_bytes(4, "little") + command + b"\x85R."


def sharded_folder(folder: Path, content: dict) -> Path:
    """A sharded checkpoint folder as hpctrain writes one (torch.distributed.checkpoint's index and shard,
    Lightning's meta.pt, hpctrain's shards.json) from a checkpoint's `content`: its state_dict and an
    optimizer's plain hyperparameters (non-tensor items in the index)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from hpctrain.runtime.run.checkpoints.folders import record_shards

    state = {"state_dict": content["state_dict"], "optimizer_0": {"lr": 0.1, "betas": (0.9, 0.99)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    meta = {k: v for k, v in content.items() if k not in ("state_dict", "optimizer_states")}
    torch.save(meta, folder / "meta.pt")
    record_shards(folder)
    return folder


class SwappedAfterFirstRead:
    """While active, every open of `path` after the first finds `payload` in its place: a colleague (or an
    attacker) replacing a file on a shared filesystem between a check and a load. `opens` counts them.
    Python's audit hook sees every `open` before it happens; one hook per process, idle when inactive."""

    _active: SwappedAfterFirstRead | None = None
    _installed = False

    def __init__(self, path: Path, payload: bytes) -> None:
        self.path, self.payload, self.opens = str(path), payload, 0

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        swap = cls._active
        if swap is None or event != "open" or str(args[0]) != swap.path:
            return
        swap.opens += 1
        if swap.opens == 2:
            cls._active = None  # the write below opens the file too
            try:
                with open(swap.path, "wb") as file:
                    file.write(swap.payload)
            finally:
                cls._active = swap

    def __enter__(self) -> SwappedAfterFirstRead:
        if not SwappedAfterFirstRead._installed:
            import sys

            sys.addaudithook(SwappedAfterFirstRead._hook)
            SwappedAfterFirstRead._installed = True
        SwappedAfterFirstRead._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        SwappedAfterFirstRead._active = None
