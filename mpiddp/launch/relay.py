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

This rests on PRRTE's internals (errmgr_dvm.c vs errmgr_prted.c), so it is used with Open MPI 5.0 only. Under the
relays a *silent* host (power off, hung kernel: no connection reset) is noticed by no daemon that ends the job
(without them, mpirun's keepalive probes, command.NODE_LOSS_ARGS, end the attempt in ~16 s): the trainer's hang
watchdog notices it and the survivors cut it off (mpiddp.job.silenthost). So the layout is on by default for
training, and off for a script under `run` (which has no such watch) unless RELAYS_FLAG asks for it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpiddp.launch.ender import AGENT_PARAMS, MCA_FLAGS
from mpiddp.launch.hosts import Host

RELAY_PREFIX = "mpiddp-relay"  # relay entries are mpiddp-relay0, mpiddp-relay1, ...: never a real host's name
MARKER = "mpiddp-agent-connected"  # what the remote side prints once the agent's connection is up
AGENT_FILE = "mpiddp-agent"  # the wrapper's file in the run dir
HOSTFILE = "mpiddp-hostfile"
# The wrapper's account of hosts whose daemon it could not start: under the relays the agent runs below a relay's
# daemon, whose output mpirun does not pass on (it exits 255 and says nothing), so launch reads this file instead
AGENT_FAILURES = "mpiddp-agent-failures"
UNREACHED = "mpiddp agent: could not reach {host}: {why}"  # one line per host, in AGENT_FAILURES and on stderr
# The wrapper's account of the hosts whose connection ended after it came up (a line each: HOST STATUS [the agent's
# last word]): at the job's
# end, a host lost mid-run, or a daemon that ended as the job started. That last one hangs: its relay carries on
# and mpirun waits for the daemon's ranks forever; launch reads this file to end such an attempt (started_without)
AGENT_ENDED = "mpiddp-agent-ended"
RADIX_PARAM = "rml_base_radix"
RELAYS_FLAG = "--host-crash-relays"  # on for a script under `run` too (training: on by default)
NO_RELAYS_FLAG = "--no-host-crash-relays"  # off: a crashed host ends the job and launch relaunches it


@dataclass(frozen=True)
class RelayLayout:
    """Whether a launch uses the relay layout, and why (or why not), in one line."""

    on: bool
    why: str
    num_relays: int = 0


NO_RELAYS = RelayLayout(False, "relay layout is off")


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
                  launch_host: str, extra: Sequence[str], wanted: bool | None = None,
                  mode: str = "train") -> RelayLayout:
    """Pure: whether the attempt's hosts get the relay layout (`hosts`: every host mpirun will run daemons on).
    `wanted`: the user's RELAYS_FLAG (True) or NO_RELAYS_FLAG (False), None when neither was given."""
    off = "host crashes end the job and launch relaunches it"
    if wanted is False:
        return RelayLayout(False, f"relay layout is off ({NO_RELAYS_FLAG}); {off}")
    if not recovery_on:
        return RelayLayout(False, f"relay layout is off: no in-job recovery; {off}")
    if wanted is None and mode != "train":
        return RelayLayout(False, f"relay layout is off for a script (launch {RELAYS_FLAG} turns it on): under it "
                                  "only the trainer's hang watchdog notices a silent host; without it mpirun ends "
                                  f"the attempt in ~16 s; {off}")
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
    silent = ("a silent one is cut off by the trainer's hang watchdog" if mode == "train" else
              "a silent one is noticed only by the script's own timeouts")
    return RelayLayout(True, f"relay layout is on: {count} relay{'s' if count > 1 else ''} on this host carry "
                             f"{len(others)} host{'s' if len(others) > 1 else ''}, so a crashed host costs an "
                             f"in-job recovery, not a restart ({silent}; this host stays a single point of "
                             "failure)", count)


def agent_script(agent: Sequence[str], folder: Path, python: str = sys.executable) -> str:
    """The wrapper's text: this python running run_agent over the user's agent, its accounts going into `folder`."""
    package = str(Path(__file__).resolve().parents[2])
    return (f"#!{python}\nimport sys\nsys.path.insert(0, {package!r})\nfrom mpiddp.launch.relay import run_agent\n"
            f"sys.exit(run_agent({list(agent)!r}, sys.argv[1:], {str(folder.resolve())!r}))\n")


def write_layout(folder: Path, agent: Sequence[str], launch_host: str, hosts: Sequence[Host],
                 count: int) -> tuple[str, ...]:
    """Write the hostfile and the agent wrapper into `folder`; the launcher arguments that use them."""
    hostfile, wrapper = folder / HOSTFILE, folder / AGENT_FILE
    hostfile.write_text(hostfile_text(launch_host, hosts, count))
    for name in (AGENT_FAILURES, AGENT_ENDED):  # an earlier attempt's hosts do not explain this one
        (folder / name).unlink(missing_ok=True)
    wrapper.write_text(agent_script(agent, folder))
    wrapper.chmod(0o755)
    return ("--hostfile", str(hostfile), "--prtemca", "plm_ssh_agent", str(wrapper), "--prtemca", RADIX_PARAM,
            str(count))


def remove_layout(folder: Path) -> None:
    """The layout's files in `folder`, gone (launch's records moved to the job's run dir)."""
    for name in (HOSTFILE, AGENT_FILE, AGENT_FAILURES, AGENT_ENDED):
        (folder / name).unlink(missing_ok=True)


# ssh's options that take a value (ssh(1): -B -b -c -D -E -e -F -I -i -J -L -l -m -O -o -P -p -Q -R -S -W -w): PRRTE
# puts its plm_ssh_args (`-p 2222 -o ConnectTimeout=5`, common where sshd listens elsewhere, as in containers)
# before the host, so the host is the first word that is neither an option nor an option's value
SSH_VALUED = frozenset("BbcDEeFIiJLlmOoPpQRSWw")


def host_index(args: Sequence[str]) -> int:
    """Where the host is in an agent command line `[options] HOST COMMAND...` (ssh's option grammar, as getopt
    reads it: `-p 2222`, `-p2222`, `-xp 2222`); len(args) when there is none."""
    index = 0
    while index < len(args) and args[index].startswith("-") and args[index] != "-":
        flags = args[index][1:]
        valued = next((at for at, flag in enumerate(flags) if flag in SSH_VALUED), None)
        index += 2 if valued is not None and valued == len(flags) - 1 else 1
    return index


def relay_command(args: Sequence[str]) -> list[str] | None:
    """The local command for a relay entry (`[options] mpiddp-relayK COMMAND...`), or None for a real host."""
    at = host_index(args)
    if at < len(args) and args[at].startswith(RELAY_PREFIX) and args[at][len(RELAY_PREFIX):].isdigit():
        return ["/bin/sh", "-c", " ".join(args[at + 1:])]
    return None


def marked_args(args: Sequence[str]) -> list[str]:
    """The agent's arguments with the marker printed first on the remote side: `[options] HOST echo MARKER; CMD`."""
    args = list(args)
    at = host_index(args)
    return [*args[:at + 1], f"echo {MARKER};", *args[at + 1:]]


def run_agent(agent: Sequence[str], args: Sequence[str], folder: str | None = None) -> int:
    """The agent wrapper: PRRTE runs it as `WRAPPER [options] HOST COMMAND...`. A host it could not reach (the
    agent ended, not 0, before the marker came back) goes into `folder`'s AGENT_FAILURES with the agent's last line;
    a host whose connection came up and then ended, into its AGENT_ENDED."""
    local = relay_command(args)
    if local is not None:
        os.execv(local[0], local)
    child = subprocess.Popen([*agent, *marked_args(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    said: list[bytes] = []
    passing = threading.Thread(target=_pass_on, args=(child.stderr, said), daemon=True)
    passing.start()
    connected = False
    for line in child.stdout:
        if not connected and line.strip() == MARKER.encode():
            connected = True
            continue
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
    status = child.wait()
    passing.join(5)
    if connected:
        _append(folder, AGENT_ENDED, f"{host_of(args)} {status} {_last_line(said)}".rstrip())
    elif status != 0:
        _record_unreached(folder, host_of(args), status, said)
    return 0 if connected else (status if status >= 0 else 128 - status)


def _pass_on(stream: Any, said: list[bytes]) -> None:
    """The agent's stderr, passed on as it comes; its last lines kept."""
    for line in stream:
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
        said[:] = [*said[-4:], line]


def host_of(args: Sequence[str]) -> str:
    """The host of an agent command line `[options] HOST COMMAND...`."""
    at = host_index(args)
    return args[at] if at < len(args) else "?"


def _last_line(said: list[bytes]) -> str:
    return next((line.decode(errors="replace").strip() for line in reversed(said) if line.strip()), "")[:200]


def _record_unreached(folder: str | None, host: str, status: int, said: list[bytes]) -> None:
    last = _last_line(said)
    why = f"the agent exited {status} before the host's daemon started" + (f" ({last})" if last else "")
    line = UNREACHED.format(host=host, why=why)
    sys.stderr.write(line + "\n")
    _append(folder, AGENT_FAILURES, line)


def _append(folder: str | None, name: str, line: str) -> None:
    """One short line onto `folder`/`name` (appends of this size from several wrappers do not interleave)."""
    if folder is None:
        return
    try:
        with open(os.path.join(folder, name), "a") as out:
            out.write(line + "\n")
    except OSError:
        pass


def agent_failures(folder: Path) -> str:
    """What the wrapper recorded of the hosts it could not reach in this attempt ("" when none)."""
    try:
        return (folder / AGENT_FAILURES).read_text()
    except OSError:
        return ""


def hosts_ended(folder: Path) -> list[tuple[str, str]]:
    """The hosts whose connection came up and then ended in this attempt (AGENT_ENDED), each once, in order, with
    how: (host, "the agent exited S[: its last word]")."""
    try:
        lines = (folder / AGENT_ENDED).read_text().splitlines()
    except OSError:
        return []
    ended: dict[str, str] = {}
    for line in lines:
        host, _, rest = line.strip().partition(" ")
        status, _, last = rest.partition(" ")
        if host and host not in ended:
            ended[host] = f"the agent exited {status}" + (f": {last}" if last else "")
    return list(ended.items())


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
