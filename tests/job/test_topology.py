"""Topology arithmetic, launcher-mismatch detection and the network choice: pure logic, no MPI."""

import pytest

from mpiddp.errors import UserError
from mpiddp.job.netif import Interface, choose_network
from mpiddp.job.topology import RankRecord, TopologyError, build_topology, launcher_info, mismatch_message


def records_for(layout):
    """layout: list of (hostname, shared-memory leader) per world rank."""
    out, next_local = [], {}
    sizes = {}
    for _, leader in layout:
        sizes[leader] = sizes.get(leader, 0) + 1
    for rank, (host, leader) in enumerate(layout):
        local = next_local.get(leader, 0)
        next_local[leader] = local + 1
        out.append(RankRecord(rank, host, leader, local, sizes[leader]))
    return out


def test_two_hosts_of_two_ranks():
    records = records_for([("a", 0), ("a", 0), ("b", 2), ("b", 2)])
    topo = build_topology(3, records, "Open MPI")
    assert (topo.rank, topo.world_size, topo.local_rank, topo.local_world_size) == (3, 4, 1, 2)
    assert (topo.host_index, topo.num_hosts, topo.hostname) == (1, 2, "b")
    assert topo.hosts_dict == {"a": [0, 1], "b": [2, 3]}
    assert not topo.is_main and build_topology(0, records).is_main


def test_round_robin_placement_numbers_hosts_by_lowest_rank():
    # mpirun --map-by node: ranks alternate between hosts
    records = records_for([("a", 0), ("b", 1), ("a", 0), ("b", 1), ("a", 0)])
    topo = build_topology(3, records)
    assert topo.hosts_dict == {"a": [0, 2, 4], "b": [1, 3]}
    assert (topo.host_index, topo.local_rank, topo.local_world_size) == (1, 1, 2)


def test_uneven_hosts():
    records = records_for([("a", 0), ("b", 1), ("b", 1), ("b", 1)])
    assert build_topology(0, records).hosts_dict == {"a": [0], "b": [1, 2, 3]}
    assert build_topology(2, records).local_rank == 1


def test_one_hostname_in_two_shared_memory_groups_is_refused():
    # two groups would both start at local rank 0 and put two ranks on cuda:0
    records = records_for([("a", 0), ("a", 1)])
    with pytest.raises(TopologyError, match="separate shared-memory groups"):
        build_topology(0, records)


def test_one_group_with_two_hostnames_is_refused():
    records = records_for([("a", 0), ("b", 0)])
    with pytest.raises(TopologyError, match="different host names"):
        build_topology(1, records)


def test_launcher_info_reads_each_launcher():
    assert launcher_info({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}).size == 4
    info = launcher_info({"PMI_SIZE": "8", "PMI_RANK": "3"})
    assert (info.size, info.rank, info.variable) == (8, 3, "PMI_SIZE")
    assert launcher_info({"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}).size == 16
    assert launcher_info({}) is None


def test_slurm_batch_step_is_not_a_launch():
    # inside an sbatch script, plain `python -m mpiddp` is one process: not a mismatch
    assert launcher_info({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_ID": "4294967291"}) is None
    assert launcher_info({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_ID": "batch"}) is None


def test_mismatch_message_names_library_and_fix():
    info = launcher_info({"PMI_SIZE": "2", "PMI_RANK": "0"})
    text = mismatch_message(info, "Open MPI v5.0.11", "/venv/mpi4py/__init__.py", "/venv/bin/python")
    assert "PMI_SIZE=2" in text and "Open MPI v5.0.11" in text and "--no-binary=mpi4py" in text


def iface(name, address, netmask="255.255.255.0"):
    return Interface(name, address, netmask)


def test_single_host_uses_loopback():
    choice = choose_network([[iface("lo", "127.0.0.1", "255.0.0.0"), iface("eth0", "10.0.0.5")]], ["a"])
    assert choice.master_addr == "127.0.0.1" and choice.interface_per_host == ("lo",)


def test_multi_host_skips_loopback_and_lookalike_bridges():
    lo = iface("lo", "127.0.0.1", "255.0.0.0")
    docker = iface("docker0", "172.17.0.1", "255.255.0.0")  # same address on every host
    host_a = [lo, docker, iface("eth0", "192.168.50.1"), iface("ib0", "10.9.0.1")]
    host_b = [lo, docker, iface("ens5", "192.168.60.2"), iface("ib0", "10.9.0.2")]
    choice = choose_network([host_a, host_b], ["a", "b"])
    assert choice.master_addr == "10.9.0.1"
    assert choice.interface_per_host == ("ib0", "ib0")


def test_interface_names_may_differ_per_host():
    host_a = [iface("eth0", "10.0.0.1")]
    host_b = [iface("enp3s0", "10.0.0.2")]
    assert choose_network([host_a, host_b], ["a", "b"]).interface_per_host == ("eth0", "enp3s0")


def test_no_common_network_is_a_clear_error():
    with pytest.raises(UserError, match="--master-addr"):
        choose_network([[iface("eth0", "10.0.0.1")], [iface("eth0", "10.1.0.1")]], ["a", "b"])


def test_srun_with_the_wrong_mpi_plugin_is_told_about_srun_mpi():
    from mpiddp.job.topology import LauncherInfo, mismatch_message

    info = LauncherInfo(4, 0, "SLURM_STEP_NUM_TASKS", "Slurm's srun")
    text = mismatch_message(info, "MPICH Version: 4.2.0", "/x/mpi4py/__init__.py", "/venv/bin/python")
    assert "srun --mpi=pmi2" in text and "srun --mpi=list" in text and "mpirun" in text
    assert "srun --mpi=pmix" in mismatch_message(info, "Open MPI v5.0.11", "/x", "/venv/bin/python")


def test_requeue_count_comes_from_slurm():
    from mpiddp.job.topology import launcher_restarts

    assert launcher_restarts({"SLURM_RESTART_COUNT": "2"}) == (2, "the scheduler")
    assert launcher_restarts({}) == (0, "") and launcher_restarts({"SLURM_RESTART_COUNT": "x"}) == (0, "")
    assert launcher_restarts({"MPIDDP_RESTART_COUNT": "1"}) == (1, "launch")
    # launch inside a requeued sbatch: its first attempt is the scheduler's restart, its relaunch its own
    assert launcher_restarts({"SLURM_RESTART_COUNT": "1", "MPIDDP_RESTART_COUNT": "0"}) == (1, "the scheduler")
    assert launcher_restarts({"SLURM_RESTART_COUNT": "1", "MPIDDP_RESTART_COUNT": "1"}) == (1, "launch")


def test_gpu_binding_follows_what_each_rank_sees(monkeypatch):
    import torch

    from mpiddp.errors import UserError
    from mpiddp.job.bootstrap import choose_device, shared_gpus
    from mpiddp.job.flags import DistSettings
    from mpiddp.trainer.config import TrainingSettings
    from mpiddp.trainer.state import device_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    topo = build_topology(2, [RankRecord(r, "gpu-a", 0, r, 4) for r in range(4)])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert choose_device(DistSettings(), topo) == ("cuda", "nccl", 2)  # all GPUs visible: cuda:<local rank>
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert choose_device(DistSettings(), topo) == ("cuda", "nccl", 0)  # one visible GPU per rank
    with pytest.raises(UserError, match="no bfloat16 support"):
        choose_device(DistSettings(), topo, device_check(TrainingSettings(amp="bf16"), topo.label))
    shared_gpus([("gpu-a", "GPU-1"), ("gpu-a", "GPU-2"), ("gpu-b", "GPU-1"), ("gpu-b", None)])
    with pytest.raises(UserError, match="ranks 0 and 2 on gpu-a both use GPU GPU-1"):
        shared_gpus([("gpu-a", "GPU-1"), ("gpu-a", "GPU-2"), ("gpu-a", "GPU-1")])


def test_nccl_keeps_its_own_interface_choice_unless_the_user_names_one():
    from mpiddp.job.bootstrap import socket_interfaces

    assert socket_interfaces("eth0", False, {}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert socket_interfaces("eth0", True, {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert socket_interfaces("eth0", True, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_a_host_that_lost_its_gpus_under_device_auto_is_named():
    from mpiddp.errors import HostFault
    from mpiddp.job.bootstrap import same_device_everywhere
    from mpiddp.job.topology import RankRecord, build_topology

    records = [RankRecord(r, f"node{r}", r, 0, 1) for r in range(3)]
    with pytest.raises(HostFault, match="node1 has no usable CUDA GPU while other hosts have"):
        same_device_everywhere("auto", ["cuda", "cpu", "cuda"], build_topology(1, records))
    same_device_everywhere("auto", ["cuda", "cpu", "cuda"], build_topology(0, records))  # rank 0's host is fine
    same_device_everywhere("auto", ["cpu", "cpu", "cpu"], build_topology(1, records))  # a CPU job
