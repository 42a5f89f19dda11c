"""This host's IPv4 interfaces, and the choice of the one network that connects every host of the job."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import NamedTuple

from mpiddp.errors import UserError

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


class Interface(NamedTuple):
    name: str
    address: str
    netmask: str

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.netmask}", strict=False)

    @property
    def is_loopback(self) -> bool:
        return ipaddress.IPv4Address(self.address).is_loopback


class NetworkChoice(NamedTuple):
    master_addr: str
    interface_per_host: tuple[str, ...]  # interface name on each host, in host-index order


def local_interfaces() -> list[Interface]:
    """IPv4 interfaces that are up and have an address (Linux ioctl; no third-party dependency)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
                netmask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, request)[20:24])
            except OSError:  # no IPv4 address on this interface
                continue
            found.append(Interface(name, address, netmask))
    return found


def choose_network(per_host: list[list[Interface]], host_names: list[str]) -> NetworkChoice:
    """Pick rank 0's address on a network that every other host also has an address on.

    per_host[0] is rank 0's host. Loopback never qualifies, and neither does a network where another host
    carries the very same address (docker0-style bridges look identical on every host and connect nothing).
    """
    assert len(per_host) == len(host_names) >= 1
    if len(per_host) == 1:
        return NetworkChoice("127.0.0.1", ("lo",))
    for candidate in per_host[0]:
        if candidate.is_loopback:
            continue
        network = candidate.network
        chosen = [candidate.name]
        for interfaces in per_host[1:]:
            match = next(
                (
                    i
                    for i in interfaces
                    if not i.is_loopback
                    and i.address != candidate.address
                    and ipaddress.IPv4Address(i.address) in network
                ),
                None,
            )
            if match is None:
                break
            chosen.append(match.name)
        else:
            return NetworkChoice(candidate.address, tuple(chosen))
    listing = "; ".join(
        f"{host}: {', '.join(f'{i.name}={i.address}/{i.netmask}' for i in interfaces) or 'none'}"
        for host, interfaces in zip(host_names, per_host)
    )
    raise UserError(
        f"no network connects all {len(per_host)} hosts (interfaces: {listing}). "
        f"Pass --master-addr with an address of {host_names[0]} that every host can reach"
    )


class Reach(NamedTuple):
    """How one host reaches an address, as its kernel would route it."""

    local: bool  # the host carries the address itself (its own traffic to it never leaves the host)
    interface: str | None  # the interface the kernel sends from (None: unknown, or no route)
    problem: str | None  # why there is no route, e.g. "Network is unreachable"


def resolve_ipv4(name: str) -> list[str]:
    """`name`'s IPv4 addresses as this host resolves them (its /etc/hosts, DNS), in order; [] when none."""
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(str(entry[4][0]) for entry in found))


def reach(address: str, interfaces: list[Interface]) -> Reach:
    """Ask this host's kernel how it would reach `address` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        local = True
    except OSError:
        local = False
    try:
        # Connecting a UDP socket only looks up the route: the source address it gets names the interface.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            source = probe.getsockname()[0]
    except OSError as exc:
        return Reach(local, None, exc.strerror or str(exc))
    if local:  # the interface that carries the address itself, not loopback (which routes local traffic)
        source = address if any(i.address == address for i in interfaces) else source
    exact = next((i.name for i in interfaces if i.address == source), None)
    inside = next((i.name for i in interfaces if ipaddress.IPv4Address(source) in i.network), None)
    return Reach(local, exact or inside, None)


def _example(per_host: list[list[Interface]], host_names: list[str]) -> str:
    """What to pass instead: the address mpiddp would choose by itself, if there is one."""
    try:
        choice = choose_network(per_host, host_names)
    except UserError:
        return ""
    return f" (e.g. {choice.master_addr}, or leave --master-addr out and mpiddp chooses it)"


def master_address(given: str, resolved_per_host: list[list[str]], per_host: list[list[Interface]],
                   host_names: list[str]) -> str:
    """The IPv4 address that --master-addr stands for: as rank 0's host resolves it, unless that is loopback
    in a multi-host job (Debian and Ubuntu map a host's own name to 127.0.1.1), where the other hosts' answer
    stands, provided rank 0's host carries it."""
    first = host_names[0]
    here = resolved_per_host[0]
    if not here:
        raise UserError(f"--master-addr {given} does not resolve to an IPv4 address on {first}, where rank 0 "
                        f"runs: pass an address of {first}{_example(per_host, host_names)}")
    if len(host_names) == 1:
        return here[0]
    usable = [a for a in here if not ipaddress.IPv4Address(a).is_loopback]
    if usable:
        return usable[0]
    own = {i.address for i in per_host[0]}
    elsewhere = [a for resolved in resolved_per_host[1:] for a in resolved
                 if a in own and not ipaddress.IPv4Address(a).is_loopback]
    if elsewhere:
        return elsewhere[0]
    raise UserError(f"--master-addr {given} resolves to loopback ({here[0]}) on {first}, where rank 0 runs (as "
                    f"/etc/hosts on Debian and Ubuntu maps a host's own name), and no other host can reach that: "
                    f"pass {first}'s address on a network every host shares{_example(per_host, host_names)}")


def interfaces_toward(address: str, given: str, reach_per_host: list[Reach], per_host: list[list[Interface]],
                      host_names: list[str]) -> tuple[str, ...]:
    """The interface that carries `address` on rank 0's host and the one each other host routes it through;
    a UserError naming the hosts that cannot reach it, and what to pass instead."""
    shown = given if given == address else f"{given} ({address})"
    example = _example(per_host, host_names)
    first, others = reach_per_host[0], list(zip(host_names[1:], reach_per_host[1:]))
    if not first.local:
        raise UserError(f"--master-addr {shown} is not an address of {host_names[0]}, where rank 0 runs: pass "
                        f"one of its addresses that every host can reach{example}")
    if first.interface is None:
        raise UserError(f"--master-addr {shown}: no interface of {host_names[0]} shows that address; name the "
                        f"interface with --iface NAME")
    problems = [
        (f"is an address of {host} too (a per-host bridge such as docker0, or loopback), so {host} would "
         f"only reach itself" if r.local else
         f"cannot be reached from {host} ({r.problem})" if r.problem else
         f"is reached from {host} through no interface mpiddp can name")
        for host, r in others if r.local or r.problem or r.interface is None
    ]
    if problems:
        raise UserError(f"--master-addr {shown} {'; it '.join(problems)}: pass an address of {host_names[0]} on "
                        f"a network every host shares{example}")
    return (first.interface, *(r.interface for _, r in others))  # type: ignore[return-value]
