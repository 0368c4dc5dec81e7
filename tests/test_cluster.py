"""Launch detection and preflight for launchers this machine cannot run for real (torchrun across
nodes, GPUs). SLURM itself is tested on a real cluster in test_slurm.py."""

from __future__ import annotations

import pytest
import torch

from hpctrain.runtime.distributed import launch
from hpctrain.runtime.environment import allocated, launch_checks, launched, network
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.namespaces import PYTORCH_LIGHTNING

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
    assert launched.launcher({}) == launched.LOCAL
    assert launched.launcher({"LOCAL_RANK": "1"}) == launched.CHILD
    assert launched.launcher(TORCHRUN) == launched.TORCHRUN
    assert launched.launcher({"SLURM_JOB_ID": "5"}) == launched.SLURM_BATCH
    assert launched.launcher({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}) == launched.SLURM
    assert (
        launched.launcher({**TORCHRUN, "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}) == launched.TORCHRUN
    )  # torchrun inside SLURM


def test_rank_zero_is_decided_without_torch():
    assert launched.is_rank_zero({})
    assert not launched.is_rank_zero({"LOCAL_RANK": "1"})
    assert not launched.is_rank_zero(TORCHRUN)
    assert launched.is_rank_zero({**TORCHRUN, "RANK": "0"})
    assert not launched.is_rank_zero({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"})


def test_run_id_is_shared_by_all_ranks_and_by_a_requeued_job():
    assert launched.run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"}) == "slurm-42"
    assert (
        launched.run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"})
        == "slurm-42"
    )
    assert (
        launched.run_id(
            {
                "SLURM_JOB_ID": "43",
                "SLURM_ARRAY_JOB_ID": "40",
                "SLURM_ARRAY_TASK_ID": "3",
                "SLURM_STEP_ID": "0",
            }
        )
        == "slurm-40_3"
    )
    assert launched.run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1"}) == "slurm-42.1"
    assert launched.run_id(TORCHRUN) == "torchrun-exp7"
    assert launched.run_id({}, now=0).startswith("1970-01-01")


def test_torchrun_mismatch_names_both_values():
    with pytest.raises(
        UserError, match=r"trainer.devices=2 but torchrun starts 4 processes per node \(--nproc-per-node=4\)"
    ):
        launch_checks.preflight(2, 2, "cpu", env=TORCHRUN)
    with pytest.raises(UserError, match=r"trainer.num_nodes=3 but torchrun runs on 2 node"):
        launch_checks.preflight(3, 4, "cpu", env=TORCHRUN)
    launch_checks.preflight(2, 4, "cpu", env=TORCHRUN)


def test_plain_python_cannot_span_nodes():
    with pytest.raises(UserError, match=r"trainer\.num_nodes=10 needs a launcher"):
        launch_checks.preflight(10, 1, "cpu", env={})
    launch_checks.preflight(
        2, 1, "cpu", env={"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"}
    )  # hand-launched nodes


SLURM_8_TASKS = {
    "SLURM_JOB_ID": "5",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "5",
    "SLURM_NODEID": "0",
}


def test_every_task_sees_all_gpus_of_its_node():
    env = {**SLURM_8_TASKS, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    launch_checks.preflight(1, 8, "gpu", env=env)
    assert not allocated.one_gpu_per_task(env)


def test_one_gpu_bound_to_each_task_is_used_whatever_its_local_id(monkeypatch):
    env = {**SLURM_8_TASKS, "CUDA_VISIBLE_DEVICES": "5"}  # --gpus-per-task=1 or --gpu-bind=closest
    launch_checks.preflight(1, 8, "gpu", env=env)
    assert allocated.one_gpu_per_task(env)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    environment = launch.lightning_cluster_environment(PYTORCH_LIGHTNING, env)
    # the local rank stays SLURM_LOCALID: prepare_data (Lightning runs it where local_rank == 0) and the
    # GPU sampler run on one task of the node, not on all eight at once into one data directory
    assert environment.local_rank() == 5
    assert (environment.global_rank(), environment.world_size()) == (5, 8)
    environment.validate_settings(num_devices=1, num_nodes=1)  # the trainer runs with devices=1 per task
    strategy = launch.HydraDDPStrategy(
        parallel_devices=[torch.device("cuda", 0)], cluster_environment=environment
    )
    assert strategy.root_device == torch.device("cuda", 0)  # the task's only GPU, not cuda:5
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 8, "rank": 5}


def test_a_partial_gpu_binding_that_cannot_match_tasks_is_refused():
    with pytest.raises(
        UserError, match=r"trainer.devices=8 \(tasks per node\) but this process sees 2 GPU\(s\)"
    ):
        launch_checks.preflight(1, 8, "gpu", env={**SLURM_8_TASKS, "CUDA_VISIBLE_DEVICES": "0,1"})


def test_tasks_that_would_share_a_gpu_are_refused_before_nccls_duplicate_gpu():
    """--gres=gpu:1 --ntasks-per-node=8: each task sees the one GPU, as under --gpus-per-task=1, but all
    eight see the same; NCCL refuses that at the first collective, after every rank imported and built."""
    shared = {**SLURM_8_TASKS, "CUDA_VISIBLE_DEVICES": "0"}
    for said in ({"SLURM_GPUS_ON_NODE": "1"}, {"SLURM_JOB_GPUS": "0"}, {"SLURM_STEP_GPUS": "0"}):
        with pytest.raises(UserError) as refused:
            launch_checks.preflight(1, 8, "gpu", env={**shared, **said})
        name, value = next(iter(said.items()))
        assert str(refused.value) == (
            f"trainer.accelerator=gpu with 8 tasks per node (--ntasks-per-node=8), but the job holds 1 GPU(s) "
            f"on this node ({name}={value}), so ranks would share a GPU, which NCCL refuses ('Duplicate GPU "
            "detected'); request one GPU per task (--gres=gpu:8 or --gpus-per-task=1) or submit with "
            "--ntasks-per-node=1."
        )
    # one GPU bound to each of eight: the job holds eight on the node
    launch_checks.preflight(
        1, 8, "gpu", env={**shared, "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}
    )
    launch_checks.preflight(1, 8, "cpu", env={**shared, "SLURM_GPUS_ON_NODE": "1"})  # CPU ranks share nothing
    launch_checks.preflight(
        1, 8, "gpu", env={**shared, "SLURM_GPUS_ON_NODE": "1"}, backend="gloo"
    )  # gloo may


def test_gpu_visibility_outside_slurm():
    with pytest.raises(UserError, match="sees no GPU"):
        launch_checks.preflight(1, 2, "gpu", env={"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(UserError, match=r"sees only 1 GPU\(s\).*trainer.devices=1"):
        launch_checks.preflight(1, 2, "gpu", env={"CUDA_VISIBLE_DEVICES": "0"})
    launch_checks.preflight(1, 2, "gpu", env={"CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_network_line_names_each_backends_interface_and_warns_of_loopback():
    line = network.network_summary(2, env={"MASTER_ADDR": "n1", "MASTER_PORT": "5000"}, hostname="localhost")
    assert line.startswith("network: rank 0 at n1:5000; gloo uses the address of localhost (127.0.0.1)")
    assert "loopback address other nodes cannot reach: set GLOO_SOCKET_IFNAME" in line
    chosen = network.network_summary(2, env={"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"})
    assert (
        "gloo uses GLOO_SOCKET_IFNAME=ib0; nccl uses NCCL_SOCKET_IFNAME=ib0" in chosen
        and "warning" not in chosen
    )


NODE3 = {"lo": "127.0.0.1", "eno1": "172.16.0.13", "ib0": "10.10.0.13", "ib1": None}


def _facts(host_address: str | None, master: str | None = "10.10.0.1", route: str | None = "10.10.0.13"):
    """node3 of a cluster whose nodes share ib0 (10.10/16), its hostname resolving to `host_address` (a
    management network, 172.16/16, as many sites' DNS has it); rank 0 at `master`."""
    return network.NetworkFacts("node3", dict(NODE3), host_address, master, route)


def test_gloo_binds_where_the_node_reaches_rank_0_not_where_its_hostname_points():
    env: dict[str, str] = {"MASTER_ADDR": "node1"}
    line = network.settle_gloo_interface(2, env, _facts("172.16.0.13"))
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert line == (
        "gloo uses ib0 (10.10.0.13) on node3, the interface that reaches rank 0 at node1, not 172.16.0.13 that "
        "node3 resolves to"
    )
    env = {"MASTER_ADDR": "node1"}  # a hostname that resolves to 127.0.1.1 (Debian's /etc/hosts) alike
    network.settle_gloo_interface(2, env, _facts("127.0.1.1"))
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    # where the hostname's address is the one that reaches rank 0, gloo's default stands
    env = {"MASTER_ADDR": "node1"}
    assert network.settle_gloo_interface(2, env, _facts("10.10.0.13")) is None and env == {
        "MASTER_ADDR": "node1"
    }
    # one node, or every node on this machine (torchrun by hand, the tests' cluster of several slurmd on
    # one host): nothing to settle
    assert network.settle_gloo_interface(1, env, _facts("172.16.0.13")) is None
    assert network.settle_gloo_interface(2, env, _facts("127.0.0.1", "127.0.0.1", "127.0.0.1")) is None
    local = network.NetworkFacts(
        "vm", {"lo": "127.0.0.1", "eth0": "192.0.2.2"}, "127.0.0.1", "127.0.0.1", "127.0.0.1", "node2"
    )
    assert network.settle_gloo_interface(2, env, local) is None and "GLOO_SOCKET_IFNAME" not in env


def test_rank_0s_node_whose_name_resolves_to_loopback_binds_gloo_where_others_reach_it():
    """Rank 0's own node of a real cluster: its /etc/hosts gives its name (and so MASTER_ADDR) 127.0.1.1,
    where gloo would bind and every other node would wait. With one interface other nodes can reach, gloo
    takes it; with several, one sentence asks which."""
    one = {"lo": "127.0.0.1", "eno1": "172.16.0.1"}
    env = {"MASTER_ADDR": "node1"}
    facts = network.NetworkFacts("node1", one, "127.0.1.1", "127.0.1.1", "127.0.1.1", "node1")
    assert network.settle_gloo_interface(2, env, facts) == (
        "gloo uses eno1 (172.16.0.1) on node1, its one interface other nodes can reach, not 127.0.1.1, a "
        "loopback address that node1 resolves to"
    )
    assert env["GLOO_SOCKET_IFNAME"] == "eno1"
    facts = network.NetworkFacts(
        "node1", {**one, "ib0": "10.10.0.1"}, "127.0.1.1", "127.0.1.1", "127.0.1.1", "node1"
    )
    with pytest.raises(
        UserError, match=r"^node1 and MASTER_ADDR=node1 resolve to 127.0.1.1 here, a loopback"
    ):
        network.settle_gloo_interface(2, {"MASTER_ADDR": "node1"}, facts)


def test_gloo_follows_nccls_interface_which_is_read_as_nccl_reads_it():
    env = {"NCCL_SOCKET_IFNAME": "ib"}  # a prefix: ib0, ib1; ib1 has no address
    line = network.settle_gloo_interface(2, env, _facts("172.16.0.13"))
    assert (
        env["GLOO_SOCKET_IFNAME"] == "ib0"
        and line == "gloo uses ib0 (10.10.0.13) on node3, as NCCL_SOCKET_IFNAME=ib"
    )
    assert network.nccl_matches("^ib,docker", NODE3) == ["eno1"]  # all but these, never loopback
    assert network.nccl_matches("=ib", NODE3) == [] and network.nccl_matches("=ib0,lo", NODE3) == [
        "ib0",
        "lo",
    ]
    env = {"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eno1"}  # both set: the user's choice stands
    assert (
        network.settle_gloo_interface(2, env, _facts("172.16.0.13")) is None
        and env["GLOO_SOCKET_IFNAME"] == "eno1"
    )


def test_an_interface_gloo_cannot_bind_to_is_one_sentence_before_anything_starts():
    with pytest.raises(UserError) as refused:
        network.settle_gloo_interface(2, {"GLOO_SOCKET_IFNAME": "ib1"}, _facts("10.10.0.13"))
    assert str(refused.value) == (
        "GLOO_SOCKET_IFNAME=ib1 names ib1, which is no interface with an IPv4 address on node3 (its interfaces: "
        "eno1 (172.16.0.13), ib0 (10.10.0.13), ib1, lo (127.0.0.1)), so gloo cannot bind there; set "
        "GLOO_SOCKET_IFNAME (slurm/site.sh) to the interface the nodes share (NCCL_SOCKET_IFNAME's, if set)."
    )
    with pytest.raises(
        UserError, match=r"^NCCL_SOCKET_IFNAME=hsn matches no interface with an IPv4 address on node3"
    ):
        network.settle_gloo_interface(2, {"NCCL_SOCKET_IFNAME": "hsn"}, _facts("10.10.0.13"))
    with pytest.raises(UserError) as unresolved:
        network.settle_gloo_interface(2, {}, _facts(None, master=None, route=None))
    assert str(unresolved.value).startswith(
        "node3 resolves to no address, which no interface of node3 (its interfaces: eno1 (172.16.0.13), ib0"
    )
    assert str(unresolved.value).endswith(
        "and MASTER_ADDR=unset shows no other, so gloo (the requeue signal's and folder saves' groups) has "
        "nothing to bind to; set GLOO_SOCKET_IFNAME (slurm/site.sh) to the interface the nodes share."
    )


def test_this_machines_network_is_read_without_torch():
    facts = network.network_facts({"MASTER_ADDR": "127.0.0.1"})
    assert facts.interfaces.get("lo") == "127.0.0.1" and facts.route_address == "127.0.0.1"
    assert facts.master_address == "127.0.0.1" and facts.host


def test_array_task_reads_slurms_array_variables():
    env = {
        "SLURM_ARRAY_TASK_ID": "3",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_MAX": "3",
    }
    assert launched.array_task(env) == (3, 4, "0", "3")
    assert launched.array_task({}) == (0, None, "0", "?")  # outside an array: the grid's first point


def test_one_process_is_checked_from_the_trainer_and_the_launcher():
    """src/export.py runs in one process: more, asked by the trainer config or started by a launcher,
    is one sentence; python inside an sbatch script (one process, whatever --ntasks) is fine."""
    for devices in (1, "1", "auto", [0], "0,"):
        launch_checks.preflight_one_process("export", 1, devices, env={})
    one_task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    launch_checks.preflight_one_process("export", 1, 1, env=one_task)
    launch_checks.preflight_one_process("export", 1, 1, env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    for nodes, devices in ((1, 2), (1, -1), (1, [0, 1]), (1, "0,1"), (2, 1)):
        with pytest.raises(UserError, match=r"export runs in one process, but trainer\.num_nodes="):
            launch_checks.preflight_one_process("export", nodes, devices, env={})
    with pytest.raises(UserError, match="one of 8 torchrun workers"):
        launch_checks.preflight_one_process("export", 1, 1, env=TORCHRUN)
    with pytest.raises(UserError, match="one of 4 tasks of this SLURM step"):
        launch_checks.preflight_one_process("export", 1, 1, env={**one_task, "SLURM_STEP_NUM_TASKS": "4"})
