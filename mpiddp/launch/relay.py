"""The relay layout: a compute host that crashes costs the survivors an in-job recovery, not a restart.

Open MPI 5.0.11's runtime (PRRTE 3.0.14) aborts the whole job when mpirun's own daemon loses a daemon, even under
--with-ft ulfm; a daemon that loses a *child* daemon carries on, and ULFM then reports the dead ranks to the
survivors through their broken connections. So every compute host is made a grandchild of mpirun's daemon: the
hostfile names the launch host first, then R relay entries (`slots=0`, no ranks) that the agent runs on the launch
host itself, then the compute hosts, and `--prtemca rml_base_radix R` hangs the compute hosts under the relays
(R = ceil(sqrt(hosts)): each relay carries at most R of them).

A crashed host also ends its agent connection (ssh's exit 255): PRRTE takes a failed agent for a daemon that
failed to start and aborts. The agent wrapper (run_agent, written into the run dir as an executable) therefore
runs relays locally and, for a real host, has the remote side print a marker first: once the marker came back the
connection's end is reported as a clean one (exit 0), so a host lost mid-run is never a failed start. Before the
marker, the agent's own status goes back (a host that cannot be reached still fails the start, as today).

This rests on PRRTE's internals (errmgr_dvm.c vs errmgr_prted.c), so it is used with Open MPI 5.0 only. It is
opt-in (RELAYS_FLAG): a *silent* host (power off, hung kernel: no connection reset) under the relays is noticed by
no daemon that ends the job (mpirun's keepalive probes, command.NODE_LOSS_ARGS, end the attempt in ~16 s without
the relays), so only the job's hang watchdog ends it (--hang-timeout, 600 s by default); seen on fake hosts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mpiddp.launch.ender import AGENT_PARAMS, MCA_FLAGS
from mpiddp.launch.hosts import Host

RELAY_PREFIX = "mpiddp-relay"  # relay entries are mpiddp-relay0, mpiddp-relay1, ...: never a real host's name
MARKER = "mpiddp-agent-connected"  # what the remote side prints once the agent's connection is up
AGENT_FILE = "mpiddp-agent"  # the wrapper's file in the run dir
HOSTFILE = "mpiddp-hostfile"
RADIX_PARAM = "rml_base_radix"
RELAYS_FLAG = "--host-crash-relays"  # launch's opt-in: a silent host is then no longer noticed in seconds


@dataclass(frozen=True)
class RelayLayout:
    """Whether a launch uses the relay layout, and why (or why not), in one line."""

    on: bool
    why: str
    num_relays: int = 0


NO_RELAYS = RelayLayout(False, "relay layout is off (launch --host-crash-relays asks for it)")


def num_relays(num_hosts: int) -> int:
    """R relays for `num_hosts` compute hosts (besides the launch host): each carries at most R of them."""
    return max(1, math.ceil(math.sqrt(num_hosts)))


def relay_names(count: int) -> list[str]:
    return [f"{RELAY_PREFIX}{index}" for index in range(count)]


def hostfile_text(launch_host: str, hosts: Sequence[Host], count: int) -> str:
    """The launch host first (its slots when it is a compute host too, else none), the relays (no slots), then the
    other hosts in order (in use, then spares)."""
    own = next((h for h in hosts if same_name(h.name, launch_host)), None)
    lines = [f"{own.name if own else launch_host} slots={own.slots if own else 0}"]
    lines += [f"{name} slots=0" for name in relay_names(count)]
    lines += [f"{h.name} slots={h.slots}" for h in hosts if h is not own]
    return "\n".join(lines) + "\n"


def same_name(a: str, b: str) -> bool:
    return a == b or a.split(".")[0] == b.split(".")[0]


def decide_layout(recovery_on: bool, launcher: str, flavour: str, version: str, hosts: Sequence[Host],
                  launch_host: str, extra: Sequence[str]) -> RelayLayout:
    """Pure: whether the attempt's hosts get the relay layout (`hosts`: every host mpirun will run daemons on)."""
    off = "host crashes end the job and launch relaunches it"
    if not recovery_on:
        return RelayLayout(False, f"relay layout is off: no in-job recovery; {off}")
    if launcher == "srun" or flavour != "openmpi":
        return RelayLayout(False, f"relay layout is off: it needs Open MPI's mpirun; {off}")
    if "Open MPI) 5.0." not in version:
        return RelayLayout(False, f"relay layout is off: it is verified with Open MPI 5.0 only; {off}")
    if any(RADIX_PARAM in arg or arg.startswith(("--hostfile", "--machinefile", "-H", "--host")) for arg in extra):
        return RelayLayout(False, f"relay layout is off: --launcher-args set the hosts or {RADIX_PARAM}; {off}")
    others = [h for h in hosts if not same_name(h.name, launch_host) and h.name != "localhost"]
    if len(others) < 1 or len(hosts) < 2:
        return RelayLayout(False, "relay layout is off: one compute host (nothing to survive)")
    count = num_relays(len(others))
    return RelayLayout(True, f"relay layout is on: {count} relay{'s' if count > 1 else ''} on this host carry "
                             f"{len(others)} host{'s' if len(others) > 1 else ''}, so a crashed host costs an "
                             f"in-job recovery, not a restart (this host stays a single point of failure)", count)


def agent_script(agent: Sequence[str], python: str = sys.executable) -> str:
    """The wrapper's text: this python running run_agent over the user's agent."""
    package = str(Path(__file__).resolve().parents[2])
    return (f"#!{python}\nimport sys\nsys.path.insert(0, {package!r})\n"
            f"from mpiddp.launch.relay import run_agent\nsys.exit(run_agent({list(agent)!r}, sys.argv[1:]))\n")


def write_layout(folder: Path, agent: Sequence[str], launch_host: str, hosts: Sequence[Host],
                 count: int) -> tuple[str, ...]:
    """Write the hostfile and the agent wrapper into `folder`; the launcher arguments that use them."""
    hostfile, wrapper = folder / HOSTFILE, folder / AGENT_FILE
    hostfile.write_text(hostfile_text(launch_host, hosts, count))
    wrapper.write_text(agent_script(agent))
    wrapper.chmod(0o755)
    return ("--hostfile", str(hostfile), "--prtemca", "plm_ssh_agent", str(wrapper), "--prtemca", RADIX_PARAM,
            str(count))


def relay_command(args: Sequence[str]) -> list[str] | None:
    """The local command for a relay entry (`[options] mpiddp-relayK COMMAND...`), or None for a real host."""
    for index, arg in enumerate(args):
        if arg.startswith(RELAY_PREFIX) and arg[len(RELAY_PREFIX):].isdigit():
            return ["/bin/sh", "-c", " ".join(args[index + 1:])]
        if not arg.startswith("-"):
            return None
    return None


def marked_args(args: Sequence[str]) -> list[str]:
    """The agent's arguments with the marker printed first on the remote side: `[options] HOST echo MARKER; CMD`."""
    args = list(args)
    at = next((i for i, arg in enumerate(args) if not arg.startswith("-")), len(args))
    return [*args[:at + 1], f"echo {MARKER};", *args[at + 1:]]


def run_agent(agent: Sequence[str], args: Sequence[str]) -> int:
    """The agent wrapper: PRRTE runs it as `WRAPPER [options] HOST COMMAND...`."""
    local = relay_command(args)
    if local is not None:
        os.execv(local[0], local)
    child = subprocess.Popen([*agent, *marked_args(args)], stdout=subprocess.PIPE)
    assert child.stdout is not None
    connected = False
    for line in child.stdout:
        if not connected and line.strip() == MARKER.encode():
            connected = True
            continue
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
    status = child.wait()
    return 0 if connected else (status if status >= 0 else 128 - status)


def without_agent(extra: Sequence[str]) -> list[str]:
    """The launcher arguments less the agent they name (the wrapper runs it instead: one agent on the line)."""
    out, index, args = [], 0, list(extra)
    while index < len(args):
        if args[index] in MCA_FLAGS and index + 2 < len(args) and args[index + 1] in AGENT_PARAMS:
            index += 3
            continue
        out.append(args[index])
        index += 1
    return out
