"""--master-addr: what address it stands for, which interface reaches it on each host, and the rendezvous store's
listening socket. Pure logic plus this machine's own kernel; no MPI."""

import logging
from datetime import timedelta
from types import SimpleNamespace

import pytest

from mpiddp.errors import UserError
from mpiddp.job.netif import Interface, Reach, interfaces_toward, local_interfaces, master_address, reach, resolve_ipv4
from mpiddp.job.topology import RankRecord, build_topology

LO = Interface("lo", "127.0.0.1", "255.0.0.0")
DOCKER = Interface("docker0", "172.17.0.1", "255.255.0.0")  # the same address on every host
NODEA = [LO, DOCKER, Interface("eth0", "10.77.0.1", "255.255.255.0")]
NODEB = [LO, DOCKER, Interface("ens5", "10.77.0.2", "255.255.255.0")]
HOSTS = ["nodea", "nodeb"]


def test_a_name_that_is_loopback_on_rank_0s_debian_host_stands_for_what_the_others_resolve():
    # Debian's /etc/hosts on nodea: 127.0.1.1 nodea; nodeb resolves nodea to its real address
    assert master_address("nodea", [["127.0.1.1"], ["10.77.0.1"]], [NODEA, NODEB], HOSTS) == "10.77.0.1"
    assert master_address("10.77.0.1", [["10.77.0.1"], ["10.77.0.1"]], [NODEA, NODEB], HOSTS) == "10.77.0.1"
    assert master_address("nodea", [["127.0.1.1"]], [NODEA], ["nodea"]) == "127.0.1.1"  # one host: loopback is fine


def test_a_loopback_master_addr_on_several_hosts_says_what_to_pass():
    with pytest.raises(UserError, match=r"resolves to loopback \(127.0.0.1\) on nodea.*e\.g\. 10\.77\.0\.1"):
        master_address("127.0.0.1", [["127.0.0.1"], ["127.0.0.1"]], [NODEA, NODEB], HOSTS)
    with pytest.raises(UserError, match="does not resolve to an IPv4 address on nodea"):
        master_address("nosuchhost", [[], []], [NODEA, NODEB], HOSTS)


def test_each_host_uses_the_interface_that_reaches_the_address():
    reached = [Reach(True, "eth0", None), Reach(False, "ens5", None)]
    assert interfaces_toward("10.77.0.1", "10.77.0.1", reached, [NODEA, NODEB], HOSTS) == ("eth0", "ens5")


def test_an_address_another_host_carries_too_names_that_host():
    reached = [Reach(True, "docker0", None), Reach(True, "docker0", None)]
    with pytest.raises(UserError) as error:
        interfaces_toward("172.17.0.1", "172.17.0.1", reached, [NODEA, NODEB], HOSTS)
    text = str(error.value)
    assert text.startswith("--master-addr 172.17.0.1 is an address of nodeb too") and "e.g. 10.77.0.1" in text
    assert "\n" not in text


def test_an_address_some_host_has_no_route_to_names_that_host():
    reached = [Reach(True, "eth1", None), Reach(False, None, "Network is unreachable"), Reach(False, "eth0", None)]
    hosts = ["nodea", "nodeb", "nodec"]
    nodea = [*NODEA, Interface("eth1", "10.99.0.1", "255.255.255.0")]
    with pytest.raises(UserError, match=r"10.99.0.1 cannot be reached from nodeb \(Network is unreachable\)"):
        interfaces_toward("10.99.0.1", "10.99.0.1", reached, [nodea, NODEB, NODEB], hosts)


def test_an_address_that_is_not_rank_0s_is_refused():
    reached = [Reach(False, "eth0", None), Reach(True, "ens5", None)]
    with pytest.raises(UserError, match=r"nodeb \(10.77.0.2\) is not an address of nodea, where rank 0 runs"):
        interfaces_toward("10.77.0.2", "nodeb", reached, [NODEA, NODEB], HOSTS)


def settings(**overrides):
    return SimpleNamespace(**{"master_addr": None, "iface": None, **overrides})


def test_master_addr_sets_the_interface_per_host_and_iface_still_wins():
    from mpiddp.job.bootstrap import choose_address

    topo = build_topology(0, [RankRecord(0, "nodea", 0, 0, 1), RankRecord(1, "nodeb", 1, 0, 1)])
    toward = ("10.77.0.1", [Reach(True, "eth0", None), Reach(False, "ens5", None)])
    assert choose_address(settings(master_addr="nodea"), topo, [NODEA, NODEB], toward) == (
        "10.77.0.1", {"nodea": "eth0", "nodeb": "ens5"})
    both = [[*NODEA, Interface("ib0", "10.9.0.1", "255.255.255.0")],
            [*NODEB, Interface("ib0", "10.9.0.2", "255.255.255.0")]]
    assert choose_address(settings(master_addr="nodea", iface="ib0"), topo, both, toward) == (
        "10.77.0.1", {"nodea": "ib0", "nodeb": "ib0"})


def test_this_hosts_kernel_reaches_its_own_addresses_through_their_interfaces():
    interfaces = local_interfaces()
    assert reach("127.0.0.1", interfaces) == Reach(True, "lo", None)
    assert reach("127.0.1.1", interfaces).local  # all of 127/8 is this host's (Debian's own-name address)
    for interface in interfaces:
        assert reach(interface.address, interfaces) == Reach(True, interface.name, None)
    assert resolve_ipv4("localhost")[0].startswith("127.")
    assert resolve_ipv4("no-such-host.invalid") == []


def store_listens_everywhere(port: int) -> bool:
    """Whether the TCP socket listening on `port` takes every interface (0.0.0.0 or ::), from /proc/net."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.append(int(hex_address, 16) == 0)
    assert found, f"nothing listens on port {port}"
    return any(found)


@pytest.mark.parametrize("torch_version", ["2.7.1", None])
def test_the_log_says_where_the_store_listens(monkeypatch, caplog, torch_version):
    import torch

    from mpiddp.job.bootstrap import _store_adopts_sockets, _Store

    if torch_version is not None:
        monkeypatch.setattr(torch, "__version__", torch_version)
    elif not _store_adopts_sockets(torch.__version__):
        pytest.skip(f"torch {torch.__version__} cannot bind the store to one address")
    store = _Store()
    caplog.set_level(logging.INFO, logger="mpiddp.job.bootstrap")
    _, port = store.open_on_main("127.0.0.1", 1, timedelta(seconds=10))
    try:
        told_every_interface = "listens on every interface" in caplog.text
        assert told_every_interface == store_listens_everywhere(port)
        assert told_every_interface == (torch_version is not None)
    finally:
        store.close()
