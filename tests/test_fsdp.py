"""FSDP2 on CPU (trainer=fsdp_cpu, gloo): the template shards a model that has no configure_model, its
checkpoints are folders of shards committed atomically, and a run resumed from one ends as the
uninterrupted run did; the folder is read back, checked and consolidated on one process."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.runtime.distributed import fsdp
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import folders as checkpoint_folders
from hpctrain.runtime.storage.checkpoints import sharded, trainable_only
from tests.helpers import ROOT, assert_ok, metrics_without_timing, run_dirs, run_entry, run_script, train

QUICK = ("experiment=quickstart", "trainer=fsdp_cpu", "trainer.max_epochs=3", "trainer.log_every_n_steps=5")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(4, 2)


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.metric = nn.Identity()  # no parameters: not a root


def test_auto_shards_the_outermost_blocks_the_network_repeats():
    module = Module()
    networks = fsdp.roots(module)
    assert networks == [module.net]
    assert fsdp.blocks(networks, "auto") == list(module.net.blocks)  # not the Linear layers inside them
    assert fsdp.blocks(networks, ["LayerNorm"]) == [b.norm for b in module.net.blocks]
    with pytest.raises(UserError, match=r"dist.fsdp.shard names Attention, which the model does not contain"):
        fsdp.blocks(networks, ["Attention"])
    module.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(UserError, match="holds parameters of its own"):
        fsdp.roots(module)


def test_a_folder_is_committed_whole_and_a_kill_between_the_renames_loses_nothing(tmp_path: Path):
    def folder(name: str, content: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "__0_0.distcp").write_text(content)
        return path

    target = tmp_path / "last.ckpt"
    checkpoint_folders.commit_folder(folder(".last.ckpt.tmp-a", "first"), target, "a")
    assert (target / "__0_0.distcp").read_text() == "first"
    checkpoint_folders.commit_folder(folder(".last.ckpt.tmp-b", "second"), target, "b")
    assert (target / "__0_0.distcp").read_text() == "second" and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["last.ckpt"]
    # killed after the old folder was set aside, before the new one arrived; and an unfinished save of
    # a process that is gone (pid 2**22 + 1 is above Linux's pid_max) beside one of a live process
    target.rename(tmp_path / ".last.ckpt.old-c")
    dead = checkpoint_folders.staging_path(target, "c", f"{socket.gethostname()}.{2**22 + 1}")
    live = checkpoint_folders.staging_path(target, "d", f"{socket.gethostname()}.{os.getppid()}")
    folder(dead.name, "half")
    folder(live.name, "in progress")
    assert checkpoint_folders.committed(target) == tmp_path / ".last.ckpt.old-c"  # what a restart reads
    checkpoint_folders.recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".last.ckpt.old-c", live.name])
    checkpoint_folders.commit_folder(folder(".last.ckpt.tmp-e", "third"), target, "e")  # the next save
    assert (target / "__0_0.distcp").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", live.name])


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return sharded.read_folder(folder)["state_dict"]


@pytest.mark.slow
def test_a_sharded_run_resumed_mid_epoch_ends_as_the_uninterrupted_run(tmp_path: Path):
    """Saved at step 15 (mid second epoch, 10 steps per epoch on 2 ranks), resumed from that folder: the
    final weights are bit-equal and the metrics after the save equal; then the folder is read on one
    process, continued on one process (2 -> 1), consolidated, tested and refused when broken."""
    saved = tmp_path / "mid.ckpt"
    save_at = [
        "+callbacks.save_at._target_=tests.differential.user_code.SaveAtStep",
        "+callbacks.save_at.step=15",
        f"+callbacks.save_at.path={saved}",
    ]
    env = {"PYTHONPATH": str(ROOT)}
    # written asynchronously (checkpoints.async_save): the resume below proves what those saves hold
    first = train(tmp_path / "a", *QUICK, *save_at, "checkpoints.async_save=true", env=env)
    assert_ok(first)
    assert (
        "FSDP2: 4 block(s) sharded over 2 process(es) (Conv2d, Linear), then MNISTCNN as root(s)"
        in first.stdout
    )
    assert sorted(p.name for p in saved.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
        "shards.json",
    ]
    assert_ok(train(tmp_path / "b", *QUICK, f"ckpt_path={saved}"))
    (uninterrupted,), (resumed,) = run_dirs(tmp_path / "a"), run_dirs(tmp_path / "b")
    final = [_state(r / "checkpoints" / "last.ckpt") for r in (uninterrupted, resumed)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    tail = [
        [{k: v for k, v in r.items() if v} for r in metrics_without_timing(run) if int(r["step"]) > 15]
        for run in (uninterrupted, resumed)
    ]
    assert tail[0] and tail[0] == tail[1]
    assert not list((uninterrupted / "checkpoints").glob(".*"))  # no staging folder left behind

    # one model out: a single weights-only file and a .safetensors file, equal to the shards
    out = tmp_path / "model.ckpt"
    result = run_script("scripts/consolidate.py", str(saved), str(out))
    assert_ok(result)
    single = torch.load(out, weights_only=True)
    assert all(torch.equal(single["state_dict"][k], v) for k, v in _state(saved).items())
    assert "optimizer_states" not in single and out.with_suffix(".safetensors").is_file()
    again = run_script("scripts/consolidate.py", str(saved), str(out))
    assert again.returncode != 0 and "exists; pass another output path" in again.stdout

    # hpctrain.load of the folder: the model, whole, on this one process
    import hpctrain

    loaded = hpctrain.load(saved)
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in _state(saved).items())

    # eval of the folder on one process (trainer=cpu), as of the file
    evaluated = run_entry("eval.py", f"ckpt_path={saved}", "trainer=cpu", f"paths.log_dir={tmp_path / 'e'}")
    assert_ok(evaluated)
    assert "test/acc" in evaluated.stdout

    # broken folders: one sentence each (checked in this process; eval says it as the process's error)
    missing = tmp_path / "missing.ckpt"
    shutil.copytree(saved, missing)
    (missing / "__1_0.distcp").unlink()
    swapped = tmp_path / "swapped.ckpt"
    shutil.copytree(saved, swapped)
    shutil.copy(uninterrupted / "checkpoints" / "last.ckpt" / "__1_0.distcp", swapped / "__1_0.distcp")
    for folder, sentence in (
        (missing, "is missing its shard __1_0.distcp"),
        (swapped, "is not the one this checkpoint was saved with"),
        (tmp_path / "e", "is a folder but not a checkpoint"),
    ):
        with pytest.raises(UserError, match=sentence):
            sharded.check_folder(folder)
    refused = run_entry("eval.py", f"ckpt_path={missing}", "trainer=cpu", f"paths.log_dir={tmp_path / 'r'}")
    assert refused.returncode != 0 and "error: ckpt_path=" in refused.stdout
    assert "is missing its shard __1_0.distcp" in refused.stdout and "Traceback" not in refused.stdout


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path: Path):
    """Rank 1 dies mid-save (its shard of the second epoch's checkpoint written, the index not yet): the
    job ends, last.ckpt is still the first epoch's, complete and loadable, and the next start clears
    the unfinished folder."""
    killed = train(
        tmp_path,
        "experiment=quickstart",
        "trainer=fsdp_cpu",
        "trainer.max_epochs=2",
        "+callbacks.kill._target_=tests.differential.user_code.KillRankAtSave",
        "+callbacks.kill.rank=1",
        "+callbacks.kill.step=20",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert killed.returncode != 0
    (run,) = run_dirs(tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    content = sharded.read_folder(last)
    assert content["global_step"] == 10 and content["epoch"] == 0  # the first epoch's, whole
    assert list((run / "checkpoints").glob(".*.tmp-*"))  # the unfinished save, under its hidden name
    from hpctrain.runtime.storage.checkpoints import remove_partial_saves

    remove_partial_saves(run)  # what the next start does first
    assert not list((run / "checkpoints").glob(".*")) and sharded.read_folder(last)["global_step"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_cpu"])  # fsdp_cpu: the mid-epoch resume test saves asynchronously
def test_an_asynchronous_save_writes_what_a_synchronous_one_does(tmp_path: Path, strategy: str):
    """checkpoints.async_save=true: the state copied at the save is what lands on disk, committed whole."""
    common = ("experiment=quickstart", f"trainer={strategy}", "trainer.max_epochs=1", "test=false")
    assert_ok(train(tmp_path / "sync", *common))
    assert_ok(train(tmp_path / "async", *common, "checkpoints.async_save=true"))
    (sync,), (asynchronous,) = run_dirs(tmp_path / "sync"), run_dirs(tmp_path / "async")
    read = _state if strategy == "fsdp_cpu" else lambda p: torch.load(p, weights_only=True)["state_dict"]
    expected, written = (read(r / "checkpoints" / "last.ckpt") for r in (sync, asynchronous))
    assert expected.keys() == written.keys() and all(torch.equal(expected[k], written[k]) for k in expected)
    assert not list((asynchronous / "checkpoints").glob(".*"))  # nothing left half-written


TINY_TRANSFORMER = (
    "experiment=char_transformer",
    "trainer=fsdp_cpu",
    "model.net.n_layer=2",
    "model.net.n_embd=64",
    "model.net.n_head=4",
    "model.net.dropout=0.0",
    "data.batch_size=8",
    "data.block_size=32",
    "trainer.max_steps=20",
    "trainer.max_epochs=-1",
    "trainer.limit_train_batches=null",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "monitor.metric=null",
    "callbacks.early_stopping=null",
    "test=false",
)


def _losses(run: Path) -> list[float]:
    return [float(r["train/loss"]) for r in metrics_without_timing(run) if r.get("train/loss")]


@pytest.mark.slow
def test_tensor_parallel_trains_as_fsdp_alone_does(tmp_path: Path):
    """The character Transformer's plan on a 2 x 2 mesh (4 processes: data-parallel 2, tensor-parallel 2)
    against FSDP alone on 2 processes: the same 20 losses within rtol 1e-4 (dropout 0), the gradients
    clipped at every step (at 0.01, far below their norm: over both meshes under tensor parallelism)."""
    clipped = "trainer.gradient_clip_val=0.01"
    assert_ok(train(tmp_path / "fsdp", *TINY_TRANSFORMER, clipped))
    split = train(tmp_path / "tp", *TINY_TRANSFORMER, clipped, "trainer.devices=4", "dist.tensor_parallel=2")
    assert_ok(split)
    assert "tensor parallel: 12 layer(s) split over 2 process(es) each" in split.stdout
    (alone,), (parallel,) = run_dirs(tmp_path / "fsdp"), run_dirs(tmp_path / "tp")
    expected, found = _losses(alone), _losses(parallel)
    assert len(expected) == len(found) == 20
    assert found == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow  # a process each (the preflight refuses before torch): kept out of the quick tier's 30 s
@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (
            ("experiment=quickstart", "trainer.devices=4", "dist.tensor_parallel=2"),
            "ships no tensor-parallel plan",
        ),
        (
            ("experiment=char_transformer", "trainer.devices=4", "dist.tensor_parallel=3"),
            "does not divide the 4 processes",
        ),
        (
            ("experiment=quickstart", "trainer=ddp_cpu", "dist.tensor_parallel=2"),
            "needs trainer=fsdp or trainer=fsdp_cpu",
        ),
    ],
)
def test_tensor_parallel_settings_that_cannot_work_are_one_sentence(tmp_path: Path, overrides, sentence):
    refused = train(tmp_path, "trainer=fsdp_cpu", *overrides)
    assert refused.returncode != 0 and sentence in refused.stdout, refused.stdout[-2000:]
    assert "Traceback" not in refused.stdout


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint (weights and optimizer states), whole, by its key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = sharded.check_folder(folder)
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in index.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    return tensors


@pytest.mark.slow
def test_a_checkpoint_of_4_processes_loads_losslessly_on_2_and_one_of_2_on_1(tmp_path: Path):
    """Weights and optimizer states as loaded (gathered whole as training starts) equal the saved ones,
    bit for bit, on fewer processes; the run says where its data position went."""
    env = {"PYTHONPATH": str(ROOT)}
    source = ["experiment=quickstart", "trainer=fsdp_cpu", "trainer.max_epochs=1", "test=false"]
    assert_ok(train(tmp_path / "four", *source, "trainer.devices=4"))
    saved = run_dirs(tmp_path / "four")[0] / "checkpoints" / "last.ckpt"
    assert len(list(saved.glob("*.distcp"))) == 4
    for devices, log_dir, epochs in ((2, "two", 2), (1, "one", 3)):
        dump = tmp_path / f"loaded-{devices}.pt"
        resumed = train(
            tmp_path / log_dir,
            "experiment=quickstart",
            "trainer=fsdp_cpu",
            f"trainer.devices={devices}",
            f"trainer.max_epochs={epochs}",  # one more epoch than the checkpoint's
            "test=false",
            f"ckpt_path={saved}",
            "+callbacks.dump._target_=tests.differential.user_code.DumpLoadedState",
            f"+callbacks.dump.path={dump}",
            env=env,
        )
        assert_ok(resumed)
        assert f"resumed on {devices} process(es) from a checkpoint saved by " in resumed.stdout
        loaded, expected = torch.load(dump, weights_only=True), _all_tensors(saved)
        assert loaded.keys() <= expected.keys() and any(k.startswith("optimizer_0.state.") for k in loaded)
        assert all(torch.equal(loaded[k], expected[k]) for k in loaded), [
            k for k in loaded if not torch.equal(loaded[k], expected[k])
        ]
        saved = run_dirs(tmp_path / log_dir)[0] / "checkpoints" / "last.ckpt"  # 2 -> 1 next


@pytest.mark.slow
def test_a_module_that_shards_itself_is_left_alone_and_told_apart_from_dist_fsdp_shard(tmp_path: Path):
    from tests.differential.cases import user_overrides

    env = {"PYTHONPATH": str(ROOT)}
    own = [*user_overrides("SelfShardingClassifier"), "trainer=fsdp_cpu", "trainer.max_epochs=1"]
    ran = train(tmp_path / "own", *own, env=env)
    assert_ok(ran)
    assert "FSDP2:" not in ran.stdout  # hpctrain sharded nothing: the module did
    refused = train(tmp_path / "both", *own, "dist.fsdp.shard=[Linear]", env=env)
    assert refused.returncode != 0
    assert "SelfShardingClassifier shards itself in configure_model, and dist.fsdp.shard=" in refused.stdout


@pytest.mark.slow
def test_activation_checkpointing_and_bf16_compute_train(tmp_path: Path):
    result = train(
        tmp_path,
        "experiment=quickstart",
        "trainer=fsdp_cpu",
        "trainer.max_epochs=2",
        "dist.fsdp.activation_checkpointing=true",
        "dist.fsdp.param_dtype=bfloat16",
        "dist.fsdp.reduce_dtype=float32",
    )
    assert_ok(result)
    rows = metrics_without_timing(run_dirs(tmp_path)[0])
    losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(losses) == 2 and losses[1] < losses[0]  # it learns


def _buffers_on_two_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    module = nn.BatchNorm1d(3)
    module.running_mean.fill_(float(rank + 1))  # differs per rank: 1 and 2
    module.running_var.fill_(1 / 3)  # the same on both
    state = fsdp._agreed_buffers(
        {k: v.clone() for k, v in module.state_dict().items()}, module, torch.device("cpu")
    )
    if rank == 0:
        torch.save(state, out)
    dist.destroy_process_group()


def test_buffers_that_differ_per_rank_are_averaged_in_what_is_saved(tmp_path: Path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "state.pt"
    mp.start_processes(_buffers_on_two_ranks, args=(port, str(out)), nprocs=2, start_method="fork")
    state = torch.load(out, weights_only=True)
    assert torch.equal(state["running_mean"], torch.full((3,), 1.5))
    assert torch.equal(state["running_var"], torch.full((3,), 1 / 3))  # agreed: bit for bit, not re-averaged


def test_the_device_meshs_groups_get_the_configured_collective_timeout(tmp_path: Path):
    """torch gives the groups of a device mesh its own default (10 minutes on NCCL): after the first step
    they get dist.timeout_min, as the default group does."""
    from datetime import timedelta

    import torch.distributed as dist

    from hpctrain.callbacks.rank_watchdog import _set_timeout

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.new_group()
        _set_timeout(7, [group])
        for each in (dist.group.WORLD, group):
            assert each._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=7)
    finally:
        dist.destroy_process_group()


def test_under_cpu_offload_the_sharded_parameters_stay_in_host_memory_and_the_rest_moves(tmp_path: Path):
    """What a GPU needs, in the order FSDP2 needs it: the sharded parameters of a module sharded with
    CPUOffloadPolicy stay in host memory (FSDP2 refuses them on the GPU at the first forward; Lightning
    moved the whole module there), while buffers and metric states go to the device. The device here is
    `meta`, a device that is not the host; on a GPU node `scripts/gpu_checks.py` trains with it (cpu_offload)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchmetrics import MeanMetric

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        module = nn.Module()
        module.net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        module.loss = MeanMetric()
        fsdp.apply_fsdp(module, init_device_mesh("cpu", (1,)), {"shard": "auto", "cpu_offload": True})
        fsdp.offloaded_to(module, torch.device("meta"))
        assert {p.to_local().device.type for p in module.parameters()} == {"cpu"}
        assert {b.device.type for b in module.buffers()} == {"meta"}  # BatchNorm's statistics
        assert module.loss.mean_value.device.type == "meta"
    finally:
        dist.destroy_process_group()


def test_fsdp_under_mixed_precision_gathers_in_half_precision_unless_told_otherwise():
    from hpctrain.runtime.run.build import fsdp_dtypes

    assert fsdp_dtypes({"shard": "auto"}, "bf16-mixed") == {
        "shard": "auto",
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
    }
    assert fsdp_dtypes({}, "16-mixed") == {}  # refused under FSDP2 before this (config/checks.py)
    assert fsdp_dtypes({"param_dtype": "float32"}, "bf16-mixed") == {"param_dtype": "float32"}  # as given
    assert fsdp_dtypes({}, "32-true") == {}


class _Split(nn.Module):
    """A network of which tensor parallelism splits two layers (`up` by columns, `down` by rows) and leaves
    two whole (`embed`, `head`): after sharding, gradients on a 2-D mesh and on the data-parallel one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.up, self.down, self.head = (
            nn.Linear(6, 8),
            nn.Linear(8, 16),
            nn.Linear(16, 8),
            nn.Linear(8, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(x)))))


class _Holder(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def _clipped_on_a_2x2_mesh(rank: int, port: int, out: str) -> None:
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    reference = _Split()
    held = _Holder(copy.deepcopy(reference))
    fsdp.apply_tensor_parallel([held.net], mesh["tensor_parallel"], {"colwise": ["up"], "rowwise": ["down"]})
    fsdp.apply_fsdp(held, mesh["data_parallel"], {"shard": "auto"})
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)) * 10  # norms well above max_norm
    data = mesh["data_parallel"].get_local_rank()
    # FSDP averages the gradients over the data-parallel ranks: each its half of the global batch
    held.net(batch[4 * data : 4 * data + 4]).pow(2).mean().backward()
    total = fsdp.clip_grad_norm_over_meshes(held.parameters(), max_norm=0.5)
    reference(batch).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    meshes = {p.grad.device_mesh.ndim for p in held.parameters()}
    clipped = {n: p.grad.full_tensor() for n, p in held.net.named_parameters()}
    for module in (held, reference):  # all frozen: a trainable-only checkpoint's fingerprint of them
        module.requires_grad_(False)
    fingerprints = [trainable_only.fingerprint(held)["sums"], trainable_only.fingerprint(reference)["sums"]]
    if rank == 0:
        whole = {n: p.grad for n, p in reference.named_parameters()}
        found = {"total": total, "expected": expected, "meshes": meshes, "clipped": clipped, "whole": whole}
        torch.save({**found, "fingerprints": fingerprints}, out)
    dist.destroy_process_group()


@pytest.mark.slow  # four processes
def test_clipping_and_a_frozen_fingerprint_under_tensor_parallel_are_one_process_s(tmp_path: Path):
    """Gradients on two meshes (the split layers on data x tensor, the rest on data): the total norm and
    the clipped gradients equal those of the whole network on one process, clipped by torch. The frozen
    part's fingerprint (trainable-only checkpoints) sums each shard once along each mesh dimension it is
    split on: the one process's (it asked a 2-D mesh for its one group and failed)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "clipped.pt"
    # forkserver: a fork of this worker, which may have run autograd, cannot run a backward pass
    mp.start_processes(_clipped_on_a_2x2_mesh, args=(port, str(out)), nprocs=4, start_method="forkserver")
    found = torch.load(out, weights_only=True)
    assert found["meshes"] == {1, 2}  # the case one norm over every gradient fails on
    assert found["expected"] > 0.5 * 4  # it clips
    assert torch.allclose(found["total"], found["expected"], rtol=1e-5)
    for name, grad in found["whole"].items():
        assert torch.allclose(found["clipped"][name], grad, rtol=1e-4, atol=1e-6), name
    split, whole = found["fingerprints"]
    assert len(split) == len(whole) == 8 and torch.allclose(split, whole, rtol=1e-12)


@pytest.mark.slow
def test_accumulated_micro_batches_reduce_their_gradients_once_per_optimizer_step(tmp_path: Path):
    """accumulate_grad_batches=2 under FSDP2: the first micro-batch of each step reduces nothing, the
    second reduces every unit's gradients; dist.fsdp.sync_each_micro_batch=true reduces every one."""
    import json

    env = {"PYTHONPATH": str(ROOT)}
    common = (
        "experiment=quickstart",
        "trainer=fsdp_cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.accumulate_grad_batches=2",
        "data.batch_size=8",
        "monitor.metric=null",
        "callbacks.early_stopping=null",
        "test=false",
        "+callbacks.count._target_=tests.differential.user_code.CountGradientReduces",
    )
    counts = {}
    for case, extra in (("once", ()), ("each", ("dist.fsdp.sync_each_micro_batch=true",))):
        out = tmp_path / f"{case}.json"
        assert_ok(train(tmp_path / case, *common, f"+callbacks.count.path={out}", *extra, env=env))
        counts[case] = json.loads(out.read_text())
    units = counts["each"][0]
    assert units > 0 and counts["each"] == [units] * 4
    assert counts["once"] == [0, units, 0, units]


@pytest.mark.slow  # torch.compile imports dynamo: seconds
def test_compile_under_fsdp2_is_left_to_the_sharding_block_by_block(tmp_path: Path):
    """compile=true: under DDP the network is compiled whole, as built; under FSDP2 (hpctrain's sharding)
    it is not, the strategy compiles each block's forward before sharding it."""
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.run import build
    from tests.helpers import compose_train

    compiled = ("experiment=char_transformer", "compile=true", "compile_backend=eager")
    for trainer, whole in (("ddp_cpu", True), ("fsdp_cpu", False)):
        cfg = compose_train(tmp_path, tmp_path, *compiled, f"trainer={trainer}")
        module = build.model(cfg.model, Settings.of(cfg))  # with the template's switches
        assert (module.net._compiled_call_impl is not None) == whole, trainer
    strategy = build.strategy(Settings.of(cfg).trainer, Settings.of(cfg).dist, compile_backend="eager")
    assert strategy.compile_backend == "eager"
    block = module.net.blocks[0]
    fsdp._compiled_and_checkpointed(block, "eager", recompute=False)
    assert block._compiled_call_impl is None and "forward" in vars(block)  # its forward, hooks outside


# Evaluation on splits that 2 data-parallel ranks share unevenly, in batches of 4: 17 validation samples of
# the digits (shares of 9 and 8: 3 batches and 2 when batched plainly) and 41 test samples (21 and 20). Under
# FSDP2 every forward is a collective: without batches evened out, the rank with more waits in its last
# forward, declared hung within seconds under these timeouts (the sanity check validates every batch).
UNEVEN = ("data.val_fraction=0.00946", "data.test_fraction=0.0228", "data.batch_size=4")
SHORT_TIMEOUTS = ("dist.timeout_min=0.2", "dist.init_timeout_min=0.25")


def _evaluated(run: Path) -> dict[str, float]:
    rows = metrics_without_timing(run)
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith(("val/", "test/")) and v}


@pytest.mark.slow
def test_validation_and_test_on_an_uneven_split_under_fsdp2_count_each_sample_once(
    trained_run: Path, tmp_path: Path
):
    """The sanity check over every batch, the validation after a step that changes nothing (lr 1e-30) and the
    test after fit, on trained weights: the metrics of one process, every sample once."""
    common = (
        "experiment=quickstart",
        f"init_from.path={trained_run / 'checkpoints' / 'last.ckpt'}",
        "model.optimizer.lr=1e-30",  # a step that changes nothing that shows
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "trainer.num_sanity_val_steps=-1",
        *UNEVEN,
    )
    one = train(tmp_path / "one", *common, "trainer=cpu")
    sharded_run = train(tmp_path / "fsdp", *common, "trainer=fsdp_cpu", *SHORT_TIMEOUTS)
    assert_ok(one)
    assert_ok(sharded_run)
    expected, found = _evaluated(run_dirs(tmp_path / "one")[0]), _evaluated(run_dirs(tmp_path / "fsdp")[0])
    assert {"val/acc", "val/loss", "test/acc", "test/loss"} <= expected.keys() == found.keys()
    assert found == pytest.approx(expected, rel=1e-6)
    # fractions of 17 and of 41 samples: a sample counted twice (a padded split) would show
    assert round(found["val/acc"] * 17, 4) % 1 == 0 and round(found["test/acc"] * 41, 4) % 1 == 0


@pytest.mark.slow
def test_prediction_on_an_uneven_split_under_fsdp2_writes_each_sample_once(trained_run: Path, tmp_path: Path):
    """src/predict.py's loader pads the ranks' shares to as many batches (the writer keeps each sample
    once): the predictions of one process, in order."""
    common = (f"ckpt_path={trained_run / 'checkpoints' / 'last.ckpt'}", "predict.split=val", *UNEVEN[:1])
    common += ("data.batch_size=4", "extras.print_config=false")
    for strategy in ("cpu", "fsdp_cpu"):
        done = run_entry(
            "predict.py",
            *common,
            f"paths.log_dir={tmp_path / strategy}",
            f"trainer={strategy}",
            "dist.timeout_min=0.25",
        )
        assert_ok(done)
    one, sharded_run = (run_dirs(tmp_path / s, "predict")[0] / "predictions.csv" for s in ("cpu", "fsdp_cpu"))
    assert len(one.read_text().splitlines()) == 1 + 17
    assert sharded_run.read_text() == one.read_text()


@pytest.mark.slow
@pytest.mark.ondemand
def test_validation_and_test_on_an_uneven_split_under_tensor_parallel_count_each_sample_once(tmp_path: Path):
    """The character Transformer on a 2 x 2 mesh (data-parallel 2, tensor-parallel 2): the loaders share the
    splits out over the data-parallel group, 17 validation and 41 test windows of 32 bytes (shares of 9
    and 8, 21 and 20), and the metrics are those of one process."""
    from myproject.data.text import stdlib_corpus

    size = len(stdlib_corpus()[0])
    common = (
        *[o for o in TINY_TRANSFORMER if not o.startswith(("trainer=", "trainer.max_", "trainer.limit_"))],
        "data.batch_size=4",
        f"data.val_fraction={560.5 / size}",  # 560 bytes: 17 windows of 32 (+1 for the target)
        f"data.test_fraction={1330.5 / size}",  # 41 windows
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "trainer.num_sanity_val_steps=-1",
        "model.optimizer.lr=1e-30",
        "test=true",
    )
    one = train(tmp_path / "one", *common, "trainer=cpu")
    split = train(
        tmp_path / "tp",
        *common,
        "trainer=fsdp_cpu",
        "trainer.devices=4",
        "dist.tensor_parallel=2",
        "dist.timeout_min=1",
        "dist.init_timeout_min=1",
    )
    assert_ok(one)
    assert_ok(split)
    expected, found = _evaluated(run_dirs(tmp_path / "one")[0]), _evaluated(run_dirs(tmp_path / "tp")[0])
    assert {"val/loss", "test/loss"} <= expected.keys() == found.keys()
    assert found == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_hsdp_shards_within_each_replica_and_trains_as_fsdp_across_all_does(tmp_path: Path):
    """dist.fsdp.replicate=2 on 4 processes, as 2 nodes of 2 would run (shard groups of consecutive ranks,
    here one machine's): each rank holds half the parameters instead of a quarter, gradients are averaged
    over all 4, so the losses are those of FSDP over all 4 (rtol 1e-5). A replica count that does not
    divide the processes is one sentence."""
    common = ("experiment=quickstart", "trainer=fsdp_cpu", "trainer.devices=4", "trainer.max_epochs=1")
    common += ("trainer.limit_train_batches=4", "trainer.limit_val_batches=1", "test=false")
    common += ("trainer.log_every_n_steps=1",)
    whole = train(tmp_path / "fsdp", *common)
    hybrid = train(tmp_path / "hsdp", *common, "dist.fsdp.replicate=2")
    assert_ok(whole)
    assert_ok(hybrid)
    assert "sharded over 2 process(es), 2 replicas of them (HSDP)" in hybrid.stdout
    expected, found = _losses(run_dirs(tmp_path / "fsdp")[0]), _losses(run_dirs(tmp_path / "hsdp")[0])
    assert len(found) == 4 and found == pytest.approx(expected, rel=1e-5)
    refused = train(tmp_path / "three", *common, "dist.fsdp.replicate=3")
    assert (
        refused.returncode == 2
        and "dist.fsdp.replicate=3 needs a number of processes it divides (4 here)" in refused.stdout
    )
