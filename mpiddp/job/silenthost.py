"""A host gone silent (power lost, kernel hung, link down): noticed by the job's own reports, confirmed by the
host's kernel, then made visible to MPI.

A crashed process closes its connections and MPI (ULFM) sees its peers fail at once. A silent host closes nothing:
its ranks' connections stay open, unanswered, for the minutes TCP takes to give up. Under in-job recovery the
hang watchdog (mpiddp.job.watchdog) covers it in three steps:
1. Rank 0's watchdog reads every rank's progress record each interval. A host whose every rank's record has not
   advanced for SILENT_HOST_S (on rank 0's own clock: the store's tick, never a remote wall clock) is *quiet*.
2. A quiet host is *silent* only when its kernel does not answer a TCP connection either (a refused connection
   is an answer): a host whose ranks are merely stopped, or busy holding the GIL, is never cut off (the hang
   watchdog covers those with --hang-timeout). Rank 0 then names the host in the store.
3. Every other rank shuts down its own process's TCP connections to that host's addresses (MPI's and gloo's).
   MPI sees broken connections, as when the host's processes are killed, declares its ranks failed, and the
   survivors recover in the job. No privilege is needed: a process may shut down its own sockets.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SILENT_HOST_S = 10.0  # a host's ranks quiet this long, and its kernel silent: cut off
PROBE_PORT = 22  # sshd on a cluster's hosts; a closed port answers too (the kernel refuses the connection)
PROBE_TIMEOUT_S = 3.0
_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket: no peer
_NO_ROUTE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


class QuietHosts:
    """Which hosts' ranks all stopped advancing their progress records, as seen by one observer over time."""

    def __init__(self, host_of_rank: Mapping[int, str], own_host: str, bound_s: float = SILENT_HOST_S) -> None:
        self.host_of_rank = dict(host_of_rank)
        self.own_host = own_host  # the observer's host answers for itself: never quiet to its own observer
        self.bound_s = bound_s
        self.seen: dict[int, tuple[Any, float]] = {}  # rank -> (its last tick, when the observer first saw it)

    def observe(self, progress: Mapping[int, Mapping[str, Any]], now: float) -> list[str]:
        """The hosts, other than the observer's, whose every rank's tick stayed the same for `bound_s` up to
        `now` (a rank not in `progress` keeps its last tick; one never seen is not judged)."""
        for rank, record in progress.items():
            tick = record.get("tick")
            if rank not in self.seen or self.seen[rank][0] != tick:
                self.seen[rank] = (tick, now)
        ranks_of: dict[str, list[int]] = {}
        for rank, host in self.host_of_rank.items():
            ranks_of.setdefault(host, []).append(rank)
        return [host for host, ranks in ranks_of.items()
                if host != self.own_host and all(r in self.seen and now - self.seen[r][1] >= self.bound_s
                                                 for r in ranks)]


def host_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback left out: where another host's connections to it may point."""
    from mpiddp.job.netif import local_interfaces

    return sorted({i.address for i in local_interfaces() if not i.is_loopback})


def kernel_answers(addresses: Iterable[str], port: int = PROBE_PORT, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the host at any of `addresses` answers a TCP connection (accepted or refused) within `timeout_s`
    in all: its kernel runs and its link is up."""
    targets = list(addresses)
    for address in targets:
        try:
            with socket.create_connection((address, port), timeout=timeout_s / max(1, len(targets))):
                return True
        except (TimeoutError, socket.timeout):  # no answer from this address
            continue
        except OSError as exc:
            if exc.errno in _NO_ROUTE:  # the host's link is down: no answer either
                continue
            return True  # refused (the kernel answered), or this side's own trouble (no descriptor): never cut
    return False


def _address_of(field: str) -> str:
    """The IP address of a /proc/net/tcp(6) field "HEX:PORT" (IPv4-mapped IPv6 as its IPv4)."""
    raw = bytes.fromhex(field.split(":")[0])
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    packed = b"".join(struct.pack("<I", int.from_bytes(word, "big")) for word in words)
    if len(packed) == 4:
        return str(ipaddress.IPv4Address(packed))
    address = ipaddress.IPv6Address(packed)
    return str(address.ipv4_mapped or address)


def peers_by_inode(tables: Iterable[str]) -> dict[int, str]:
    """socket inode -> its peer's address, from the text of /proc/net/tcp and tcp6 (listening sockets left out)."""
    found = {}
    for text in tables:
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] != _LISTEN:
                found[int(fields[9])] = _address_of(fields[2])
    return found


def own_sockets() -> dict[int, int]:
    """This process's socket inodes -> file descriptors."""
    found = {}
    folder = Path("/proc/self/fd")
    for name in os.listdir(folder):
        try:
            target = os.readlink(folder / name)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def cut_connections(addresses: Iterable[str]) -> int:
    """Shut down (both ways) this process's TCP connections to `addresses`, its own host's addresses left out
    (an address every host carries, a docker0 bridge, is this host's own); how many were cut. The next read on
    each returns end-of-file and the next write fails: whoever uses it (MPI, gloo) sees the peer gone."""
    wanted = set(addresses) - set(host_addresses())
    tables = []
    for name in ("tcp", "tcp6"):
        try:
            tables.append(Path(f"/proc/net/{name}").read_text())
        except OSError:
            continue
    peers = peers_by_inode(tables)
    cut = 0
    for inode, fd in own_sockets().items():
        if peers.get(inode) not in wanted:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:  # a shutdown acts on the socket, shared with `fd`
                sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:  # closed or never connected meanwhile
            continue
    return cut
