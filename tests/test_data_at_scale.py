"""Data that does not fit in memory: an image folder decoded in loader workers, shards made from it,
staged per node, resumed exactly with workers (1 process and DDP)."""

from __future__ import annotations

import getpass
import json
import multiprocessing
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hpctrain.data import shards, staging
from hpctrain.data.files import ImageFolderDataModule
from hpctrain.runtime.errors import UserError
from tests.helpers import assert_ok, make_shards, metrics_without_timing, run_dirs, train

SHAPE = (1, 28, 28)


def _folder(root: Path, layout: dict[str, dict[str, int]]) -> Path:
    """<root>/<split>/<class>/<i>.png with `count` small images per class (pixel value = class * 20 + i)."""
    for split, classes in layout.items():
        for name, count in classes.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                value = (list(classes).index(name) * 20 + i) % 256
                Image.new("L", (8, 6), value).save(root / split / name / f"{i}.png")
    return root


def _data(root: Path, **kwargs) -> ImageFolderDataModule:
    kwargs.setdefault("num_classes", 3)
    return ImageFolderDataModule(root=str(root), image_shape=SHAPE, batch_size=4, **kwargs)


LAYOUT = {"train": {"cat": 3, "ant": 2, "dog": 4}, "val": {"ant": 1, "dog": 2}}


def test_folder_classes_are_sorted_folder_names_and_every_file_is_read(tmp_path: Path):
    data = _data(_folder(tmp_path, LAYOUT))
    data.setup("fit")
    train, val, test = data.splits
    assert data.classes == ["ant", "cat", "dog"]
    assert train.labels.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2] and val.labels.tolist() == [0, 2, 2]
    assert len(test) == 0 and not data.has_test  # no test/: the run says "no test" instead of failing
    images, _ = train[torch.arange(len(train))]
    assert images.shape == (9, *SHAPE) and images.dtype == torch.uint8  # resized to image_shape, uint8
    assert images[2].unique().tolist() == [0]  # cat/0.png: class index 1 of the layout's order -> value 20
    assert isinstance(train.names, np.ndarray)  # numpy, not a Python list: workers share its pages


@pytest.mark.parametrize(
    "bad, classes, sentence",
    [
        (
            lambda r: (r / "train" / "cat" / "notes.txt").write_text("hi"),
            3,
            "cat/notes.txt is not a .png, .jpg or .jpeg",
        ),
        (lambda r: (r / "train" / "emu").mkdir(), 4, "class folder .*/train/emu holds no images"),
        (lambda r: (r / "val" / "yak").mkdir(), 3, "val/yak is a class that .* does not have"),
        (
            lambda r: (r / "train" / "stray.png").write_bytes(b""),
            3,
            "train/stray.png is not in a class folder",
        ),
    ],
)
def test_a_bad_folder_is_one_sentence_naming_the_file(tmp_path: Path, bad, classes: int, sentence: str):
    root = _folder(tmp_path, LAYOUT)
    bad(root)
    with pytest.raises(UserError, match=sentence):
        _data(root, num_classes=classes).setup("fit")
    skipping = _data(root, num_classes=classes, skip_bad=True)  # skip_bad: trains without them
    if "yak" not in sentence:  # a class the model has no output for cannot be skipped
        skipping.setup("fit")
        assert len(skipping.splits[0]) == 9


def test_a_wrong_number_of_classes_gives_the_right_one(tmp_path: Path):
    with pytest.raises(UserError, match=r"data.num_classes=3\.$"):
        _data(_folder(tmp_path, LAYOUT), num_classes=5).check_available()


def test_an_unreadable_image_is_named_or_skipped_and_counted(tmp_path: Path):
    root = _folder(tmp_path, LAYOUT)
    good = (root / "train" / "dog" / "0.png").read_bytes()
    (root / "train" / "dog" / "1.png").write_bytes(good[: len(good) // 2])  # truncated
    (root / "train" / "ant" / "9.jpg").write_text("not an image")  # an image's name, not its content
    data = _data(root)
    data.setup("fit")
    batch = data.splits[0][torch.arange(len(data.splits[0]))]
    with pytest.raises(UserError, match=r"train/ant/9.jpg cannot be read as an image; .* data.skip_bad=true"):
        data.on_before_batch_transfer(batch, 0)

    skipping = _data(root, skip_bad=True)
    skipping.setup("fit")
    images, labels = skipping.on_before_batch_transfer(skipping.splits[0][torch.arange(10)], 0)
    assert len(images) == len(labels) == 8 and skipping.skipped_files == 2  # of 10 files, 2 unreadable
    assert (labels >= 0).all()
    # -1 is "no label" (src/predict.py's inputs: a folder of images, a tensor file): never a bad file
    unlabelled = (torch.zeros(3, *SHAPE, dtype=torch.uint8), torch.full((3,), -1))
    assert data.on_before_batch_transfer(unlabelled, 0) is unlabelled


def _shard_set(tmp_path: Path, sizes: tuple[int, ...] = (3, 4)) -> tuple[Path, dict]:
    """A shard set written with the converter's own writer (no subprocess): random bytes as files."""
    root, out = tmp_path / "files", tmp_path / "shards"
    entries = []
    for number, count in enumerate(sizes):
        names = []
        for i in range(count):
            path = root / f"{number}-{i}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(1000 + i))
            names.append(os.fsencode(path.name))
        entries.append(
            shards.write_shard(
                out, "train", number, root, np.array(names), np.arange(count), check=lambda d, n: True
            )
        )
    shards.write_manifest(out, ["a"], {"train": entries, "val": entries[:1]}, source=str(root))
    return out, shards.read_manifest(out)


def test_staging_copies_once_checks_sha256_and_a_later_attempt_reuses_it(tmp_path: Path):
    out, manifest = _shard_set(tmp_path)
    local = staging.stage(out, tmp_path / "scratch", shards.manifest_files(manifest), shards.MANIFEST)
    assert (
        local == tmp_path / "scratch" / f"hpctrain-{getpass.getuser()}" / "shards"
    )  # a folder of the user's own
    assert stat.S_IMODE(local.parent.stat().st_mode) == 0o700
    for name, _size, _ in shards.manifest_files(manifest):
        assert (local / name).read_bytes() == (out / name).read_bytes()
    stamp = (local / staging.MARKER).stat().st_mtime_ns
    assert (
        staging.stage(out, tmp_path / "scratch", shards.manifest_files(manifest), shards.MANIFEST) == local
    )  # reused: the marker and sizes match
    assert (local / staging.MARKER).stat().st_mtime_ns == stamp
    (local / "train" / "shard-00001.bin").unlink()  # scratch partly wiped between attempts: copy again
    staging.stage(out, tmp_path / "scratch", shards.manifest_files(manifest), shards.MANIFEST)
    assert (local / "train" / "shard-00001.bin").is_file()

    with open(out / "train" / "shard-00000.bin", "r+b") as file:
        first = file.read(1)
        file.seek(0)
        file.write(bytes([first[0] ^ 0xFF]))  # the shared copy changed after the manifest was written
    with pytest.raises(UserError, match="does not match the sha256 its manifest lists"):
        staging.stage(out, tmp_path / "elsewhere", shards.manifest_files(manifest), shards.MANIFEST)


def test_a_staged_copy_that_is_not_the_users_own_is_never_read(tmp_path: Path):
    """Scratch such as /tmp is shared: a folder planted under the user's name, or one others may write,
    is refused in one sentence, and a staged file that is not the user's is copied again, not read."""
    out, manifest = _shard_set(tmp_path)
    files = shards.manifest_files(manifest)
    planted = tmp_path / "scratch" / f"hpctrain-{getpass.getuser()}"
    planted.mkdir(parents=True, mode=0o777)
    os.chmod(planted, 0o777)
    with pytest.raises(
        UserError, match="may be written by others, so a staged copy in it could be someone else's"
    ):
        staging.stage(out, tmp_path / "scratch", files, shards.MANIFEST)
    if os.geteuid() == 0:  # root can give the folder to another user, as another user would have made it
        os.chown(planted, 4321, 4321)
        os.chmod(planted, 0o700)
        with pytest.raises(UserError, match=r"belongs to another user \(uid 4321\)"):
            staging.stage(out, tmp_path / "scratch", files, shards.MANIFEST)
        os.chown(planted, os.getuid(), os.getgid())
        local = staging.stage(out, tmp_path / "scratch", files, shards.MANIFEST)
        shard = local / files[0][0]
        os.chown(shard, 4321, 4321)  # the marker and sizes match, but the file is not the user's copy
        staging.stage(out, tmp_path / "scratch", files, shards.MANIFEST)
        assert shard.stat().st_uid == os.getuid()


def _stage_and_count(out: Path, scratch: Path, manifest: dict, copies: Path) -> None:
    original = staging._copy_checked

    def counted(source, target, sha256):
        with open(copies, "a") as file:
            file.write(f"{os.getpid()} {target.name}\n")
        original(source, target, sha256)

    staging._copy_checked = counted
    staging.stage(out, scratch, shards.manifest_files(manifest), shards.MANIFEST)


def test_concurrent_processes_on_a_node_copy_once(tmp_path: Path):
    out, manifest = _shard_set(tmp_path, sizes=(50, 50, 50))
    copies = tmp_path / "copies.txt"
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=_stage_and_count, args=(out, tmp_path / "scratch", manifest, copies))
        for _ in range(4)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0]
    lines = copies.read_text().splitlines()
    assert (
        len(lines) == len(shards.manifest_files(manifest)) and len({line.split()[0] for line in lines}) == 1
    )
    assert not list((tmp_path / "scratch").rglob(".*.lock"))


def test_not_enough_space_is_one_sentence_before_copying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out, manifest = _shard_set(tmp_path)
    real = staging.shutil.disk_usage
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: real(p)._replace(free=100))
    with pytest.raises(
        UserError, match=r"has 0.0 MB free but the shards in .* need 0.0 MB; free space there"
    ):
        staging.stage(out, tmp_path / "scratch", shards.manifest_files(manifest), shards.MANIFEST)
    assert not list((tmp_path / "scratch").rglob("*.bin"))


def test_a_datamodule_that_cannot_stage_refuses_stage_dir(tmp_path: Path):
    with pytest.raises(UserError, match="make shards of them"):
        _data(tmp_path, stage_dir=str(tmp_path / "scratch"))


# --------------------------------------------------------------- real processes (converter, training)


@pytest.mark.slow
def test_shards_hold_exactly_the_folders_images_and_labels(
    image_folder: Path, digit_shards: Path, tmp_path: Path
):
    from hpctrain.data.shards import ShardsDataModule

    folder = _data(image_folder, num_classes=10)
    sharded = ShardsDataModule(root=str(digit_shards), num_classes=10, image_shape=SHAPE)
    folder.setup("fit"), sharded.setup("fit")
    manifest = json.loads((digit_shards / "manifest.json").read_text())
    assert manifest["classes"] == [str(c) for c in range(10)]
    for a, b in zip(folder.splits, sharded.splits, strict=True):
        assert len(a) == len(b) > 0 and torch.equal(a.labels, b.labels)
        assert all(a.read(i) == b.read(i) and a.name(i) == b.name(i) for i in range(len(a)))  # byte for byte
    assert len(manifest["splits"]["train"]["shards"]) > 1

    again = make_shards(image_folder, digit_shards)  # nothing already written is overwritten
    assert again.returncode == 2 and "already holds shards" in again.stdout

    # Interrupted: a shard and the manifest missing. Run again: the finished shards are kept, the rest made.
    partial = tmp_path / "partial"
    assert make_shards(image_folder, partial, "--shard-mb", "0.1").returncode == 0
    kept = (partial / "train" / "shard-00000.bin").stat().st_mtime_ns
    for name in ("manifest.json", "train/shard-00001.json", "train/shard-00001.bin"):
        (partial / name).unlink()
    resumed = make_shards(image_folder, partial, "--shard-mb", "0.1")
    assert resumed.returncode == 0, resumed.stdout[-2000:]
    assert (partial / "train" / "shard-00000.bin").stat().st_mtime_ns == kept
    assert json.loads((partial / "manifest.json").read_text())["splits"] == manifest["splits"]


def _resume_overrides(data: list[str], out: Path, *extra: str) -> list[str]:
    return [
        *data,
        "data.num_classes=10",
        "data.image_shape=[1,28,28]",
        "data.batch_size=32",
        "data.num_workers=2",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        "logger=csv",
        "test=false",
        f"paths.log_dir={out}",
        "extras.print_config=false",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "data"), [("cpu", "image_folder"), ("ddp_cpu", "shards")])
def test_mid_epoch_resume_with_workers_is_exact(
    trainer: str, data: str, digit_shards: Path, image_folder: Path, tmp_path: Path
):
    """Files read by 2 loader workers per process (an image folder in one process, its shards under
    DDP): saved mid-way through the second epoch and resumed, the run ends with the uninterrupted run's
    weights and metrics. In one process the shards also train to the folder's weights (the same files,
    in the same order)."""
    saved = tmp_path / "mid.ckpt"
    # 1,258 images / 32 per batch = 40 steps per epoch (20 per rank under DDP): save in the second epoch
    at = 50 if trainer == "cpu" else 25
    save_at = [
        "+callbacks.save_at._target_=tests.differential.user_code.SaveAtStep",
        f"+callbacks.save_at.step={at}",
        f"+callbacks.save_at.path={saved}",
    ]
    root = image_folder if data == "image_folder" else digit_shards
    chosen = [f"data={data}", f"data.root={root}", f"trainer={trainer}"]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    assert_ok(train(tmp_path / "a", *_resume_overrides(chosen, tmp_path / "a", *save_at), env=env))
    assert saved.is_file()
    assert_ok(train(tmp_path / "b", *_resume_overrides(chosen, tmp_path / "b", f"ckpt_path={saved}")))
    (uninterrupted,), (resumed,) = run_dirs(tmp_path / "a"), run_dirs(tmp_path / "b")
    final = [
        torch.load(r / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for r in (uninterrupted, resumed)
    ]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    tail = [  # the resumed run's metrics.csv is new: compare the values logged after the save, not the columns
        [{k: v for k, v in r.items() if v} for r in metrics_without_timing(run) if int(r["step"]) > at]
        for run in (uninterrupted, resumed)
    ]
    assert tail[0] == tail[1] and tail[0]

    if trainer == "cpu":  # the shards of the folder, same seed: the same weights
        sharded = ["data=shards", f"data.root={digit_shards}", "trainer=cpu"]
        assert_ok(train(tmp_path / "c", *_resume_overrides(sharded, tmp_path / "c")))
        (from_shards,) = run_dirs(tmp_path / "c")
        weights = torch.load(from_shards / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        assert all(torch.equal(weights[k], final[0][k]) for k in weights)


def test_threads_and_workers_follow_the_cpus_a_process_has(tmp_path: Path):
    from hpctrain.runtime.environment import allocated

    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    assert allocated.cpus_per_process(1, {**step, "SLURM_CPUS_PER_TASK": "8"}, affinity=64)[0] == 8
    assert allocated.cpus_per_process(1, {**step, "SLURM_NTASKS_PER_NODE": "4"}, affinity=16)[0] == 4
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}
    assert allocated.cpus_per_process(1, torchrun, affinity=16)[0] == 4
    assert allocated.cpus_per_process(2, {}, affinity=2)[0] == 1  # Lightning's two local ranks share 2 CPUs
    assert allocated.cpus_per_process(4, {}, affinity=2)[0] == 1
    # devices: auto on GPUs, outside Slurm and torchrun: Lightning starts one process per GPU
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    assert allocated.cpus_per_process("auto", {}, affinity=32, accelerator="gpu", dev=dev)[0] == 8
    assert (
        allocated.cpus_per_process(
            -1, {"CUDA_VISIBLE_DEVICES": "0,1"}, affinity=32, accelerator="auto", dev=dev
        )[0]
        == 16
    )
    assert (
        allocated.cpus_per_process("auto", {}, affinity=32, accelerator="cpu", dev=dev)[0] == 32
    )  # one process


def test_auto_gives_decoding_datamodules_workers_and_the_rest_threads(tmp_path: Path, data_dir: Path):
    from hpctrain.runtime.config.settings import Settings
    from hpctrain.runtime.environment import allocated
    from hpctrain.runtime.run.build import cpu_plan
    from tests.helpers import IMAGE_DATA, compose_train

    cpus = allocated.cpus_per_process(1)[0]
    folder = [f"data.root={data_dir}/digits_images", *IMAGE_DATA]
    cfg = compose_train(tmp_path, data_dir, "data=image_folder", *folder)
    threads, workers, line = cpu_plan(cfg.data, Settings.of(cfg))
    assert workers == min(8, max(1, cpus - 1)) and threads == max(1, cpus - workers)
    assert f"{workers} loader worker(s) (data.num_workers=auto)" in line
    cfg = compose_train(tmp_path, data_dir, "data=digits", "data.num_workers=auto")
    threads, workers, _ = cpu_plan(cfg.data, Settings.of(cfg))
    assert (threads, workers) == (cpus, 0)  # in memory: a batch is one tensor index, no workers
    explicit = compose_train(
        tmp_path, data_dir, "data=image_folder", *folder, "num_threads=3", "data.num_workers=5"
    )
    assert cpu_plan(explicit.data, Settings.of(explicit))[:2] == (3, None)  # given values are taken as given
