"""Files written as an attacker would write them, for the trust tests: each tries to run code that leaves a
marker file behind, so a test can tell that nothing ran (the marker is absent), not only that an error came."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hpctrain.runtime.storage.checkpoints.reading import CONFIG_KEY


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

    from hpctrain.runtime.storage.checkpoints.folders import record_shards

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


SECRET_ENV = "HPCTRAIN_TEST_SECRET"  # set to a secret value in every process the hostile-folder test runs
FROM_ENV = "${oc.env:" + SECRET_ENV + "}"
B = "\\"
# a file's strings that would read the secret if anything resolved them, with every escaping OmegaConf knows
SECRET_READERS = [FROM_ENV, B + FROM_ENV, 2 * B + FROM_ENV, 3 * B + FROM_ENV, "$" + FROM_ENV]


def spawn_walk(holder: str, marker: Path) -> dict:
    """A stored config node that, resolved by Hydra's attribute-by-attribute lookup from a module of the
    project's that imports torch, runs `touch <marker>` (multiprocessing's spawnv_passfds and /bin/sh)."""
    return {
        "_target_": f"{holder}.torch.multiprocessing.multiprocessing.util.spawnv_passfds",
        "path": {"_target_": f"{holder}.torch.os.fsencode", "_args_": ["/bin/sh"]},
        "args": ["/bin/sh", "-c", f"touch {marker}"],
        "passfds": [],
    }


def received_run_folder(
    trained: Path, run: Path, marker: Path, outside: Path, holder: str, victim: int
) -> Path:
    """A copy of a trained run dir (`trained`) at `run` with every file the template reads from a run dir
    hostile at once:

    checkpoints/last.ckpt     its stored model's network is `spawn_walk`; its stored monitor and its kept
                              hyperparameters read the secret; its ModelCheckpoint state names checkpoints
                              outside the folder (a victim Lightning would remove as the worst of its top k)
    checkpoints/epoch_000.ckpt  the project's classes, its stored monitor reading the secret
    checkpoints/sharded.ckpt/ a sharded folder of the same model (a test swaps its index after one read)
    run.yaml                  overrides whose model.net is `spawn_walk`'s target, a command, a commit that
                              is no hash but a code block, the secret's interpolation
    config.yaml, .hydra/      targets that walk, the secret's interpolation, stacks_signal SIGUSR1 (which
                              ends a process that did not register it)
    outcome.yaml              a value that is text, a metric name holding a code block
    metrics.csv               a header holding a code block, steps that are text
    stacks/pids               rank 0 is `victim`, a process of the user's on this machine
    """
    import shutil

    import yaml

    shutil.copytree(trained, run)
    walk = spawn_walk(holder, marker)
    code = f"\n```python\nimport os; os.system('touch {marker}')\n```\n"
    victim_ckpt = outside / "victim.ckpt"
    checkpoints = run / "checkpoints"
    for name in ("last.ckpt", "epoch_000.ckpt"):
        content = torch.load(checkpoints / name, map_location="cpu", weights_only=True)
        stored = content[CONFIG_KEY]
        stored["monitor"]["metric"] = FROM_ENV
        if name == "last.ckpt":
            stored["model"]["net"] = walk
            content["hyper_parameters"] = {"token": FROM_ENV, "escaped": SECRET_READERS}
            for key, state in content["callbacks"].items():
                if key.startswith("ModelCheckpoint"):
                    # inside the folder to a check that does not resolve `..` (Lightning's)
                    worst = f"{checkpoints}/{os.path.relpath(victim_ckpt, checkpoints)}"
                    state.update(
                        dirpath=str(checkpoints),  # the attacker guessed where it would be resumed
                        best_model_path=str(outside / "best.ckpt"),
                        best_model_score=torch.tensor(0.0),  # any epoch is better: the worst one is removed
                        kth_best_model_path=worst,
                        kth_value=torch.tensor(0.0),
                        last_model_path=str(victim_ckpt),
                        best_k_models={worst: torch.tensor(0.0)},
                    )
        torch.save(content, checkpoints / name)
    sharded_folder(
        checkpoints / "sharded.ckpt", torch.load(checkpoints / "epoch_000.ckpt", weights_only=True)
    )
    overrides = [f"model.net._target_={walk['_target_']}", f"+data.token={FROM_ENV}", "hydra.job.env_set.K=v"]
    record = yaml.safe_load((run / "run.yaml").read_text())
    record.update(
        command=f"train.py {' '.join(overrides)}",
        overrides=overrides,
        git={"commit": f"abc{code}", "dirty": "yes", "snapshot": "../../outside"},
    )
    (run / "run.yaml").write_text(yaml.safe_dump(record))
    hostile_config = {"model": {"net": walk, "token": FROM_ENV}, "diagnostics": {"stacks_signal": "SIGUSR1"}}
    (run / "config.yaml").write_text(yaml.safe_dump(hostile_config))
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(hostile_config))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    outcome = {
        "status": f"completed{code}",
        "metric": f"val/acc{code}",
        "value": "0.99 (text)",
        "error": FROM_ENV,
        "overrides": overrides,
        "test": {"test/acc": "text"},
        "cost": "text",
    }
    (run / "outcome.yaml").write_text(yaml.safe_dump(outcome))
    header = ["step", "epoch", f"val/acc{code}", FROM_ENV]
    rows = [["0", "0", "0.5", "1"], ["text", "x", "0.6", "2"]]
    (run / "metrics.csv").write_text(
        "\n".join(",".join(f'"{c}"' for c in row) for row in [header, *rows]) + "\n"
    )
    (run / "stacks" / "pids").write_text(f"0 {victim} {__import__('socket').gethostname()}\n")
    return run
