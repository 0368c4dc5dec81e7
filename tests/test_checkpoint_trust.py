"""A checkpoint is data: a hostile file runs no code, through every way hpctrain reads one.

Each hostile file tries to leave a marker file behind (tests/hostile.py); a test passes only when the
read is refused in one sentence AND the marker is absent. The DCP index is read by an unpickler that
admits exact (module, name) pairs, and the pairs are enumerated from what the installed torch writes, so
a torch release that adds a class to its index fails here first."""

from __future__ import annotations

import copy
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import hpctrain
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import reading, sharded
from tests import hostile
from tests.helpers import EXAMPLES, require_modules, run_entry, run_script


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "the hostile file ran code"


# ----------------------------------------------------------------------------------- the DCP index


class _Recording(pickle.Unpickler):
    def __init__(self, file, seen: set[tuple[str, str]]) -> None:
        super().__init__(file)
        self.seen = seen

    def find_class(self, module: str, name: str):
        self.seen.add((module, name))
        return super().find_class(module, name)


def _dcp_index_globals(folder: Path) -> set[tuple[str, str]]:
    """Every (module, name) the installed torch pickles into a DCP index: an FSDP2-sharded network and its
    AdamW state (DTensors, optimizer hyperparameters as non-tensor items), saved as Lightning's
    ModelParallelStrategy saves them, on a one-process gloo group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(folder.parent / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        net.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        fully_shard(net[0], mesh=mesh)
        fully_shard(net, mesh=mesh)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95))
        net(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        state = {
            "state_dict": get_model_state_dict(net),
            "optimizer_0": get_optimizer_state_dict(net, optimizer),
        }
        dcp.save(state, checkpoint_id=str(folder))
    finally:
        dist.destroy_process_group()
    seen: set[tuple[str, str]] = set()
    with open(folder / sharded.INDEX_FILE, "rb") as file:
        _Recording(file, seen).load()
    return seen


@pytest.mark.slow  # a process group and a DCP save: seconds
def test_the_index_unpickler_admits_exactly_what_dcp_writes(tmp_path: Path):
    written = _dcp_index_globals(tmp_path / "ckpt")
    dtypes = {(m, n) for m, n in written if m == "torch" and isinstance(getattr(torch, n, None), torch.dtype)}
    unknown = written - sharded._ALLOWED - dtypes
    assert not unknown, f"this torch writes {sorted(unknown)} into a DCP index: add them to sharded._ALLOWED"
    index = sharded.check_folder(tmp_path / "ckpt")  # and reads that very index back
    assert index.state_dict_metadata


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.filesystem", "os.system"),  # dotted: attribute by attribute
        ("torch.distributed.checkpoint.filesystem", "os"),
        ("torch.distributed.checkpoint.metadata", "dataclasses"),
        ("torch", "load"),
        ("torch", "float32.__class__"),
        ("builtins", "eval"),
    ],
)
def test_the_index_unpickler_refuses_any_other_name(module: str, name: str):
    with pytest.raises(pickle.UnpicklingError, match="is not part of a checkpoint index"):
        sharded._IndexUnpickler(io.BytesIO()).find_class(module, name)


def test_a_hostile_folder_index_runs_nothing(tmp_path: Path, marker: Path):
    folder = hostile.folder_index(tmp_path / "last.ckpt", marker)
    with pytest.raises(
        UserError, match=r"holds other Python objects \(torch.distributed.checkpoint.filesystem.os.system"
    ):
        reading.read(folder)
    with pytest.raises(UserError, match="holds other Python objects"):
        hpctrain.load(folder)


@pytest.mark.parametrize("shard", ["../outside.distcp", "/etc/passwd", "sub/../../x.distcp"])
def test_a_shard_outside_its_folder_is_refused(tmp_path: Path, shard: str):
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 64)
    folder = hostile.index_folder(tmp_path / "last.ckpt", shard)
    with pytest.raises(UserError, match="which lies outside the checkpoint folder"):
        sharded.check_folder(folder)


def test_an_index_that_declares_more_than_its_shards_hold_is_one_sentence_before_any_allocation(
    tmp_path: Path,
):
    """2**42 float32 values (16 TiB) declared over an 8-byte shard: refused from the sizes alone."""
    folder = hostile.index_folder(tmp_path / "last.ckpt", "__0_0.distcp", shard_bytes=8, elements=2**42)
    (folder / "__0_0.distcp").write_bytes(b"\0" * 8)
    says = r"does not match its shards on disk: state_dict.w declares 4398046511104 elements of float32"
    with pytest.raises(UserError, match=says):
        reading.read(folder)
    with pytest.raises(UserError, match=says):
        hpctrain.load(folder)


def test_an_index_or_a_shard_record_of_another_shape_is_one_sentence(tmp_path: Path):
    folder = tmp_path / "a.ckpt"
    folder.mkdir()
    (folder / sharded.INDEX_FILE).write_bytes(pickle.dumps({}))
    with pytest.raises(
        UserError, match=r"has an index \(.metadata\) that is not a checkpoint's \(it holds a dict\)"
    ):
        sharded.check_folder(folder)
    folder = hostile.index_folder(tmp_path / "b.ckpt", "__0_0.distcp")
    (folder / "__0_0.distcp").write_bytes(b"\0" * 8)
    (folder / "shards.json").write_text("[]")
    with pytest.raises(UserError, match=r"its shards\.json is not a record of shard files"):
        sharded.check_folder(folder)


def _sharded_net_folder(folder: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2-sharded network and its AdamW state, saved as hpctrain saves a sharded checkpoint, on a
    one-process gloo group (destroyed by the caller); the network and optimizer, to compare with."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpctrain.runtime.storage.checkpoints.folders import record_shards

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.8, 0.9))
    net(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {"state_dict": get_model_state_dict(net), "optimizer_0": get_optimizer_state_dict(net, optimizer)}
    dcp.save(state, checkpoint_id=str(folder))
    torch.save({"epoch": 0, "global_step": 1}, folder / sharded.META_FILE)
    record_shards(folder)
    return net, optimizer


@pytest.mark.slow  # DCP saves and loads, a one-process gloo group: seconds
def test_a_sharded_folder_is_read_once_whatever_is_swapped_in_after(tmp_path: Path, marker: Path):
    """The index is parsed once, by hpctrain; torch gets that parse and never opens .metadata: a file
    swapped in after the first read (a shared filesystem, a colleague's folder) is never read, through
    reading a folder whole (eval, predict, export, hpctrain.load, consolidate) and through a resumed
    FSDP2 run's load of weights and optimizer states (`load_into`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    content = {"state_dict": {"w": torch.arange(6.0).view(3, 2)}, "epoch": 1, "global_step": 2}
    folder = hostile.sharded_folder(tmp_path / "file.ckpt", content)
    with hostile.SwappedAfterFirstRead(folder / sharded.INDEX_FILE, hostile.shell_pickle(marker)) as swap:
        read = reading.read(folder)
    assert swap.opens == 1 and torch.equal(read["state_dict"]["w"], content["state_dict"]["w"])

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        saved, saved_optimizer = _sharded_net_folder(tmp_path / "fsdp.ckpt")
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1.0, betas=(0.1, 0.2))
        index = tmp_path / "fsdp.ckpt" / sharded.INDEX_FILE
        with hostile.SwappedAfterFirstRead(index, hostile.shell_pickle(marker)) as swap:
            meta = sharded.load_into(tmp_path / "fsdp.ckpt", net, {"optimizer_0": optimizer})
        assert swap.opens == 1 and meta == {"epoch": 0, "global_step": 1}
        for mine, theirs in zip(net.parameters(), saved.parameters(), strict=True):
            assert torch.equal(mine.full_tensor(), theirs.full_tensor())
        group = optimizer.param_groups[0]
        assert group["lr"] == 1e-3 and tuple(group["betas"]) == (0.8, 0.9)  # non-tensor items, weights_only
        assert saved_optimizer.state and len(optimizer.state) == len(saved_optimizer.state)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a DCP save and load
def test_a_non_tensor_item_is_loaded_with_weights_only_even_past_the_check(tmp_path: Path, marker: Path):
    """torch's planner loads a non-tensor item with weights_only=False; hpctrain's refuses a pickled object
    there, in one sentence, even for a shard changed after `check_folder` looked at it."""

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    folder = hostile.sharded_folder(tmp_path / "last.ckpt", {"state_dict": {"w": torch.ones(2)}})
    import torch.distributed.checkpoint as dcp

    dcp.save({"optimizer_0": {"lr": Payload()}}, checkpoint_id=str(folder), no_dist=True)  # after the check
    reader = sharded._ParsedIndexReader(folder, sharded.read_index(folder))
    with pytest.raises(UserError, match=r"its item optimizer_0.lr holds Python objects that weights_only"):
        sharded._load({"optimizer_0": {"lr": 0.0}}, folder, reader, "ckpt_path")


def test_a_checkpoint_callbacks_state_names_only_files_inside_its_folder(tmp_path: Path, caplog):
    """Lightning tests the "best" file a restored ModelCheckpoint names and removes the "worse" ones (its
    inside-the-folder test keeps `..`): paths outside the folder, symlinks followed, are dropped with one
    warning, and nothing outside it is ever removed."""
    from hpctrain.callbacks.model_checkpoint import ModelCheckpoint

    folder, outside = tmp_path / "run" / "checkpoints", tmp_path / "outside"
    folder.mkdir(parents=True)
    outside.mkdir()
    (outside / "victim.ckpt").write_bytes(b"mine")
    (folder / "link.ckpt").symlink_to(outside / "victim.ckpt")
    callback = ModelCheckpoint(dirpath=str(folder), monitor="val/acc", mode="max")
    sneaky = f"{folder}/../../outside/victim.ckpt"
    callback.load_state_dict(
        {
            "dirpath": str(folder),
            "best_model_path": str(folder / "epoch_001.ckpt"),
            "best_model_score": torch.tensor(0.5),
            "best_k_models": {
                sneaky: torch.tensor(0.1),
                str(folder / "link.ckpt"): torch.tensor(0.2),
                str(folder / "epoch_001.ckpt"): torch.tensor(0.5),
                "s3://b/x.ckpt": 0.3,
            },
            "kth_best_model_path": sneaky,
            "kth_value": "text",
            "last_model_path": str(outside / "victim.ckpt"),
        }
    )
    assert callback.best_k_models == {str(folder / "epoch_001.ckpt"): torch.tensor(0.5)}
    assert (
        callback.kth_best_model_path == "" and callback.last_model_path == "" and callback.kth_value is None
    )
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] != []
    callback._remove_checkpoint(None, sneaky)  # never outside, whoever asks
    assert (outside / "victim.ckpt").read_bytes() == b"mine"


def test_a_folder_with_a_link_out_of_it_is_refused_and_hydras_log_goes_nowhere(tmp_path: Path):
    from hpctrain.runtime import confined
    from hpctrain.runtime.config import resolvers

    run = tmp_path / "run"
    (run / "stacks").mkdir(parents=True)
    (run / "stacks" / "rank0.txt").symlink_to(tmp_path / "notes.txt")
    (run / "inside.txt").symlink_to(run / "stacks")  # a link that stays inside is the folder's own
    with pytest.raises(UserError, match=r"holds stacks/rank0.txt, a link to .*notes.txt outside it"):
        confined.check_no_links_out(run)
    (run / "train.log").symlink_to(tmp_path / "train.log")
    assert resolvers._rank_zero_file(str(run / "train.log")) == os.devnull
    assert resolvers._rank_zero_file(str(run / "eval.log")) == str(run / "eval.log")


def test_the_link_wandb_makes_to_its_service_log_is_the_runs_own_and_no_other_link_out_is(tmp_path: Path):
    """A run resumed in place with `logger=wandb` holds W&B's link from its run's logs to the service's
    log in the user's cache: that one link is W&B's, written once and never through again; a link of
    any other name there leads out of the run dir and is refused."""
    from hpctrain.runtime import confined

    run = tmp_path / "run"
    logs = run / "wandb" / "offline-run-20261127_104622-a7103c470a39" / "logs"
    logs.mkdir(parents=True)
    (logs / "debug-core.log").symlink_to(tmp_path / "cache" / "core-debug.log")
    confined.check_no_links_out(run)
    (logs / "debug.log").symlink_to(tmp_path / "notes.txt")
    with pytest.raises(UserError, match=r"holds wandb/offline-run-\S+/logs/debug.log, a link to"):
        confined.check_no_links_out(run)


# ---------------------------------------------------------------------------- a checkpoint's config


def test_a_stored_target_is_never_built_nested_too(tmp_path: Path, marker: Path):
    """A checkpoint's stored model names torch.hub.load (at the top, or as the network of this project's own
    classifier): the file proposes, the project's configs build; what they do not give is one sentence."""
    repo = hostile.hub_repo(tmp_path / "repo", marker)
    for nested in (False, True):
        path = hostile.stored_config_checkpoint(tmp_path / f"nested{nested}.ckpt", repo, nested=nested)
        key = "model.net._target_" if nested and EXAMPLES else "model._target_"
        with pytest.raises(UserError, match=rf"was trained with {key}=torch.hub.load.*do not give"):
            hpctrain.load(path)
        assert not marker.exists()


SECRET = "s3cret-not-for-output"
B = "\\"
# a file's string, with every escaping OmegaConf knows: none may reach the secret through any reader
STORED_STRINGS = [
    "${oc.env:HPCTRAIN_TEST_SECRET}",
    B + "${oc.env:HPCTRAIN_TEST_SECRET}",
    2 * B + "${oc.env:HPCTRAIN_TEST_SECRET}",
    3 * B + "${oc.env:HPCTRAIN_TEST_SECRET}",
    "$${oc.env:HPCTRAIN_TEST_SECRET}",
    "a ${oc.env:HPCTRAIN_TEST_SECRET,x} b",
    "${oc.env:HPCTRAIN_TEST_SECRET",
    "???",
]


def test_a_stored_string_never_resolves_whatever_escaping_it_carries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A file's string never reaches OmegaConf as a value to resolve: one that could interpolate is not
    taken (the project's own value stands), at a key of the data or of the monitor, and at a model key it is
    one sentence; the secret appears nowhere."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("HPCTRAIN_TEST_SECRET", SECRET)
    options = {"model": "mnist_cnn", "model/net": "mnist_cnn", "data": "digits"}
    composed = reading.compose("train", sorted(f"{g}={o}" for g, o in options.items()))
    monkeypatch.setattr(reading, "compose", lambda *_: copy.deepcopy(composed))  # the same options: once
    for i, text in enumerate(STORED_STRINGS):
        path = tmp_path / f"{i}.ckpt"
        stored = {"choices": options, "monitor": {"metric": text}, "data": {"pin_memory": text}}
        torch.save({"state_dict": {}, reading.CONFIG_KEY: stored}, path)
        given, _ = reading.config_from_checkpoint(OmegaConf.create({"seed": 1}), path, [])
        assert given.monitor.metric == "val/acc" and given.data.pin_memory is None  # the project's own
        assert SECRET not in OmegaConf.to_yaml(given, resolve=True)
        stored["model"] = {"net": {"dropout": text}}
        torch.save({"state_dict": {}, reading.CONFIG_KEY: stored}, path)
        with pytest.raises(UserError, match=r"was trained with model.net.dropout=") as refused:
            reading.config_from_checkpoint(OmegaConf.create({}), path, [])
        assert SECRET not in str(refused.value)


def test_a_classic_pickle_is_refused_before_it_runs(tmp_path: Path, marker: Path):
    path = hostile.classic_pickle(tmp_path / "pickled.ckpt", marker)
    with pytest.raises(UserError, match="holds pickled Python objects"):
        hpctrain.load(path)


def test_the_safetensors_metadata_is_never_built_from(tmp_path: Path, marker: Path):
    """init_from reads a .safetensors file's tensors only: the config in its metadata chooses nothing."""
    require_modules("safetensors")
    from hpctrain.runtime.storage.checkpoints import init_from

    repo = hostile.hub_repo(tmp_path / "repo", marker)
    path = hostile.safetensors_file(tmp_path / "model.safetensors", repo)
    net = nn.Module()
    net.net = nn.Linear(2, 2, bias=False)
    init_from.apply(net, path, strict=True, exclude=[], prefix="")
    assert torch.equal(net.net.weight, torch.zeros(2, 2))


# -------------------------------------------------------------------- through every entry point


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    marker = root / "code-ran"
    repo = hostile.hub_repo(root / "repo", marker)
    return {
        "marker": marker,
        "folder index": hostile.folder_index(root / "folder" / "last.ckpt", marker),
        "stored target": hostile.stored_config_checkpoint(root / "target.ckpt", repo),
        "classic pickle": hostile.classic_pickle(root / "pickled.ckpt", marker),
    }


ENTRY_POINTS = {  # how each entry point is handed a file
    "train ckpt_path": ("train.py", "ckpt_path={}"),
    "train init_from": ("train.py", "init_from.path={}"),
    "eval": ("eval.py", "ckpt_path={}"),
    "predict": ("predict.py", "ckpt_path={}"),
    "export": ("export.py", "ckpt_path={}"),
}
SAYS = {
    "folder index": "holds other Python objects",
    "stored target": "was trained with model._target_=torch.hub.load ",
    "classic pickle": "holds pickled Python objects",
}
CASES = [
    (kind, entry)
    for kind in SAYS
    for entry in ENTRY_POINTS
    # training builds from the project's configs and reads only the weights of a file
    if not (kind == "stored target" and entry.startswith("train"))
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, entry", CASES, ids=[f"{k}, {e}" for k, e in CASES])
def test_no_entry_point_runs_a_hostile_file(
    kind: str, entry: str, hostile_files: dict[str, Path], tmp_path: Path
):
    script, argument = ENTRY_POINTS[entry]
    result = run_entry(
        script,
        f"paths.log_dir={tmp_path}",
        "extras.print_config=false",
        "trainer=cpu",
        argument.format(hostile_files[kind]),
        timeout=120,
    )
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and SAYS[kind] in errors[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert not hostile_files["marker"].exists(), f"{entry} ran the code of a {kind}"


@pytest.mark.slow
def test_consolidate_runs_no_hostile_index(hostile_files: dict[str, Path], tmp_path: Path):
    result = run_script(
        "scripts/consolidate.py", str(hostile_files["folder index"]), str(tmp_path / "out.ckpt")
    )
    assert result.returncode == 2 and "holds other Python objects" in result.stdout, result.stdout[-2000:]
    assert not hostile_files["marker"].exists() and not (tmp_path / "out.ckpt").exists()
