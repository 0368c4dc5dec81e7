"""Streams (IterableDatasets) under DDP: Lightning shares out only map-style datasets, so a stream is
read in full by every rank unless it shares itself out. The template says so once, with the fix, and
a job whose ranks run out of data after different numbers of batches ends at once, naming the rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hpctrain.data.iterable import ShardedIterable, shares_itself_out, stream_share
from tests.differential.cases import user_overrides
from tests.helpers import ROOT, assert_ok, train

STREAM = ["trainer=ddp_cpu", "test=false"]


class _Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_sharded_iterable_gives_each_worker_its_share():
    assert stream_share().count == 1
    assert list(ShardedIterable(_Numbers())) == list(range(10))  # one process, no workers: everything
    loader = DataLoader(ShardedIterable(_Numbers()), batch_size=None, num_workers=2)
    assert sorted(int(x) for x in loader) == list(range(10))  # two workers: each item exactly once
    assert shares_itself_out(ShardedIterable(_Numbers())) and not shares_itself_out(_Numbers())
    assert shares_itself_out(torch.utils.data.TensorDataset(torch.zeros(3)))  # map-style: Lightning's sampler


def test_under_tensor_parallelism_a_stream_is_shared_over_the_data_parallel_group(tmp_path: Path):
    """The ranks of a tensor-parallel group train the same samples: they read the same share."""
    import torch.distributed as dist

    from hpctrain.runtime import run_state
    from hpctrain.runtime.distributed import job_store

    run_state.begin()  # the data-parallel group is this run's: ended below, as a job's end would
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        job_store.set_data_parallel(2, 1)  # as on ranks 2 and 3 of 4 with dist.tensor_parallel=2
        share = stream_share()
        assert (share.index, share.count, share.rank, share.world_size) == (1, 2, 1, 2)
        assert list(ShardedIterable(_Numbers())) == [1, 3, 5, 7, 9]
    finally:
        run_state.end()
        run_state.begin()  # a fresh run: nothing of this one's group
        assert job_store.data_parallel() is None
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_stream_that_does_not_share_itself_out_is_warned_about_once(tmp_path: Path):
    result = train(
        tmp_path,
        *user_overrides("LitClassifier", data="UnshardedStreamData"),
        *STREAM,
        "trainer.max_epochs=1",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert_ok(result)
    warning = (
        "the training set DigitStream is an IterableDataset, which Lightning does not share out across ranks"
    )
    assert result.stdout.count(warning) == 1, result.stdout[-3000:]
    assert "hpctrain.data.iterable.ShardedIterable" in result.stdout


@pytest.mark.slow
def test_ranks_with_unequal_data_end_the_job_naming_the_rank(tmp_path: Path):
    started = time.monotonic()
    result = train(
        tmp_path,
        *user_overrides("LitClassifier", data="UnevenStreamData"),
        *STREAM,
        "trainer.max_epochs=2",
        env={"PYTHONPATH": str(ROOT)},
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    errors = {line for line in result.stdout.splitlines() if line.startswith("error: ")}
    assert any(
        "rank 0 on" in e and "ran out of training data after 10 batches of epoch 0, while rank 1" in e
        for e in errors
    ), result.stdout[-4000:]
    assert "zombie" not in result.stdout and "Traceback" not in result.stdout, result.stdout[-4000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
