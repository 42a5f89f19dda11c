"""Several "hosts" on one machine: a network namespace and hostname each, joined by a bridge, for real multi-host runs.

Each host NAME gets a netns (PREFIX+NAME) with eth0 = 10.77.0.N/24 on a shared bridge, plus a decoy `docker0`
carrying 172.17.0.1/16 on every host, as Docker does: a naive "first non-loopback address" choice picks it and
cannot connect. With `debian_hosts`, each host's /etc/hosts maps its own name to 127.0.1.1, as Debian and
Ubuntu install it (the other hosts' names keep their addresses). An rsh agent runs Open MPI's remote commands
inside the named host (its netns, plus a fresh UTS namespace with that hostname), so `mpirun -H nodea:2,nodeb:2`
started inside nodea behaves as on two machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SUBNET = "10.77.0"
DECOY = "172.17.0.1/16"

AGENT = textwrap.dedent(
    """\
    #!/bin/sh
    # rsh agent for fake hosts: AGENT [ssh-style options] HOST COMMAND...
    while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
    host="$1"; shift
    export OMP_NUM_THREADS=1  # one core a host: every fake host shares this machine's cores (FakeHosts.command_on)
    exec ip netns exec "{prefix}$host" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
    """
)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "fake hosts need root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"fake hosts need `{tool}` (iproute2 / util-linux)"
    return None


class FakeHosts:
    def __init__(self, names: list[str], workdir: Path, debian_hosts: bool = False, tag: str = "") -> None:
        self.names = names
        self.debian_hosts = debian_hosts
        self.prefix = f"mpd{os.getpid() % 100000}{tag}"  # a tag tells two clusters of one test process apart
        self.switch = f"{self.prefix}sw"
        self.agent = workdir / "fakehost-agent.sh"
        self.created: list[str] = []

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def _ip(self, *args: str, netns: str | None = None) -> None:
        command = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
        subprocess.run(command, check=True, capture_output=True, text=True)

    def up(self) -> FakeHosts:
        self._ip("netns", "add", self.switch)
        self.created.append(self.switch)
        self._ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        self._ip("link", "set", "br0", "up", netns=self.switch)
        for name in self.names:
            netns = self.prefix + name
            self._ip("netns", "add", netns)
            self.created.append(netns)
            port = f"{self.prefix[-6:]}{name[-1]}"[-15:]
            self._ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
            self._ip("link", "set", port, "netns", self.switch)
            self._ip("link", "set", port, "master", "br0", netns=self.switch)
            self._ip("link", "set", port, "up", netns=self.switch)
            self._ip("link", "set", "lo", "up", netns=netns)
            # the decoy first, so it comes before eth0 in the interface list
            self._ip("link", "add", "docker0", "type", "bridge", netns=netns)
            self._ip("addr", "add", DECOY, "dev", "docker0", netns=netns)
            self._ip("link", "set", "docker0", "up", netns=netns)
            self._ip("addr", "add", f"{self.address(name)}/24", "dev", "eth0", netns=netns)
            self._ip("link", "set", "eth0", "up", netns=netns)
            etc = Path("/etc/netns") / netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts_file(name))
        self.agent.write_text(AGENT.format(prefix=self.prefix))
        self.agent.chmod(0o755)
        return self

    def private_network(self, name: str, cidr: str, interface: str = "mgmt0") -> None:
        """An interface on host `name` alone (a management network the other hosts have no route to)."""
        netns = self.prefix + name
        self._ip("link", "add", interface, "type", "bridge", netns=netns)
        self._ip("addr", "add", cidr, "dev", interface, netns=netns)
        self._ip("link", "set", interface, "up", netns=netns)

    def hosts_file(self, name: str) -> str:
        """Host `name`'s /etc/hosts."""
        own = "127.0.1.1" if self.debian_hosts else self.address(name)
        return "127.0.0.1 localhost\n" + "".join(f"{own if n == name else self.address(n)} {n}\n" for n in self.names)

    def kill_host(self, name: str) -> int:
        """SIGKILL every process inside host `name` (as if it lost power); returns how many."""
        pids = subprocess.run(["ip", "netns", "pids", self.prefix + name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        return len(pids)

    def command_on(self, name: str, command: list[str]) -> list[str]:
        """`command` run on host `name`, as a user logged in there would run it. Each fake host is a one-core
        host (OMP_NUM_THREADS=1, which mpiddp takes as the user's choice): every fake host shares this machine's
        cores, and a rank alone on its host would otherwise take them all (2 ranks x 2 threads on 2 cores, spinning
        in MPI: 5-7x slower steps, measured)."""
        return ["env", "OMP_NUM_THREADS=1", "ip", "netns", "exec", self.prefix + name, "unshare", "--uts", "/bin/sh",
                "-c", 'hostname "$0" && exec "$@"', name, *command]

    def transport_args(self) -> list[str]:
        """Reach hosts through the agent instead of ssh; Open MPI's own TCP traffic must also avoid the decoy
        bridge, exactly as on a real Docker host."""
        return ["--mca", "plm_rsh_agent", str(self.agent), "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24"]

    def openmpi_args(self) -> list[str]:
        # All fake hosts share this machine's 2 cores: no core binding, as the run/ scripts do too.
        return [*self.transport_args(), "--bind-to", "none"]

    def down(self) -> None:
        for name in self.names:
            self.kill_host(name)
        for netns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        self.created.clear()


@contextmanager
def running_fake_hosts(cluster: FakeHosts, setup: Callable[[FakeHosts], None] = lambda cluster: None) -> Iterator[FakeHosts]:
    """For fixtures: bring `cluster` up (then `setup`), or skip the test saying why it cannot be built here;
    always take it down afterwards."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        cluster.up()
        setup(cluster)
    except subprocess.CalledProcessError as exc:
        cluster.down()
        pytest.skip(f"cannot build fake hosts here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield cluster
    finally:
        cluster.down()
