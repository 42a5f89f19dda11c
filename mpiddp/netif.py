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
