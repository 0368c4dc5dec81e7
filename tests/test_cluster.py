"""Launch detection and preflight for launchers this machine cannot run for real (torchrun across
nodes, GPUs). SLURM itself is tested on a real cluster in test_slurm.py."""

from __future__ import annotations

import pytest

from hpctrain import cluster
from hpctrain.errors import UserError

TORCHRUN = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "2",
    "WORLD_SIZE": "8",
    "TORCHELASTIC_RUN_ID": "exp7",
}


def test_launcher_detection():
    assert cluster.launcher({}) == cluster.LOCAL
    assert cluster.launcher({"LOCAL_RANK": "1"}) == cluster.CHILD
    assert cluster.launcher(TORCHRUN) == cluster.TORCHRUN
    assert cluster.launcher({"SLURM_JOB_ID": "5"}) == cluster.SLURM_BATCH
    assert cluster.launcher({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}) == cluster.SLURM
    assert (
        cluster.launcher({**TORCHRUN, "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}) == cluster.TORCHRUN
    )  # torchrun inside SLURM


def test_rank_zero_is_decided_without_torch():
    assert cluster.is_rank_zero({})
    assert not cluster.is_rank_zero({"LOCAL_RANK": "1"})
    assert not cluster.is_rank_zero(TORCHRUN)
    assert cluster.is_rank_zero({**TORCHRUN, "RANK": "0"})
    assert not cluster.is_rank_zero({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"})


def test_run_id_is_shared_by_all_ranks_and_by_a_requeued_job():
    assert cluster.run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"}) == "slurm-42"
    assert (
        cluster.run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"}) == "slurm-42"
    )
    assert (
        cluster.run_id(
            {
                "SLURM_JOB_ID": "43",
                "SLURM_ARRAY_JOB_ID": "40",
                "SLURM_ARRAY_TASK_ID": "3",
                "SLURM_STEP_ID": "0",
            }
        )
        == "slurm-40_3"
    )
    assert cluster.run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1"}) == "slurm-42.1"
    assert cluster.run_id(TORCHRUN) == "torchrun-exp7"
    assert cluster.run_id({}, now=0).startswith("1970-01-01")


def test_torchrun_mismatch_names_both_values():
    with pytest.raises(
        UserError, match=r"trainer.devices=2 but torchrun starts 4 processes per node \(--nproc-per-node=4\)"
    ):
        cluster.preflight(2, 2, "cpu", env=TORCHRUN)
    with pytest.raises(UserError, match=r"trainer.num_nodes=3 but torchrun runs on 2 node"):
        cluster.preflight(3, 4, "cpu", env=TORCHRUN)
    cluster.preflight(2, 4, "cpu", env=TORCHRUN)


def test_plain_python_cannot_span_nodes():
    with pytest.raises(UserError, match=r"trainer\.num_nodes=10 needs a launcher"):
        cluster.preflight(10, 1, "cpu", env={})
    cluster.preflight(2, 1, "cpu", env={"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"})  # hand-launched nodes


def test_gpu_visibility():
    with pytest.raises(UserError, match=r"sees only 1 GPU\(s\).*--gpus-per-task"):
        cluster.preflight(
            1,
            8,
            "gpu",
            env={
                "SLURM_JOB_ID": "5",
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "8",
                "SLURM_STEP_NUM_TASKS": "8",
                "SLURM_NTASKS_PER_NODE": "8",
                "SLURM_JOB_NUM_NODES": "1",
                "CUDA_VISIBLE_DEVICES": "3",
            },
        )
    with pytest.raises(UserError, match="sees no GPU"):
        cluster.preflight(1, 2, "gpu", env={"CUDA_VISIBLE_DEVICES": ""})
    cluster.preflight(1, 2, "gpu", env={"CUDA_VISIBLE_DEVICES": "0,1"})
