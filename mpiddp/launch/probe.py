"""After a start that failed: ask each host in question whether it answers, and weigh the answers.

A start-up failure names a host (its daemon "failed to report back", ssh refused it, its daemon came up and ended
before every rank started) or none (a start past --startup-timeout: a daemon or a rank stuck somewhere). Either
way the launcher's account alone cannot tell a host that is down from a start that failed once: Open MPI's own
start-up races now and then, and sshd drops connections beyond its MaxStartups when a launcher opens many at once.
So `launch` asks: it runs `true` on the host through the agent the launcher uses (mpiddp.launch.ender.host_command),
with a deadline, before it decides.

- A named host that answers is kept for the relaunch, once per launch (`KEPT_ONCE`), where leaving it out would
  cost the run (no spare host can take its place) and --host-strikes is 1 (more already retries a host): the start
  failed, the host did not. If its start fails again it is left out as before: a fault of its own that a probe
  cannot see (a firewalled daemon port, a broken prted) costs one attempt more. Where a spare can take its place it
  is left out at once, as before: the spare costs nothing.
- After a start past --startup-timeout, a host that does not answer within PROBE_TIMEOUT_S is the one blamed
  (`unreachable`), provided another host answered: where none does, the probe may not reach hosts the way the
  launcher does (Open MPI starting its daemons through Slurm or PBS, ssh options of its own), and none is blamed.
The probe runs only when the job recorded no placement (it never started), the launcher reaches hosts through an
agent (mpirun, mpiexec; not srun), and a relaunch is left for the answers to change.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from mpiddp.launch.diagnose import STARTUP_OVERDUE_PREFIX, Failure
from mpiddp.launch.ender import end_session
from mpiddp.launch.policy import short_name

PROBE_TIMEOUT_S = 10.0  # a host that has not run `true` by then is taken for one that does not answer
PROBE_PARALLEL = 64  # hosts asked at a time (one connection each: a thousand-host start-up failure stays bounded)
KEPT_ONCE = "answered launch's probe afterwards (`true` through the launcher's agent): a start that failed, not a " \
           "host that is down; kept once, as no spare host can take its place"


def probe_command(agent: Sequence[str], host: str) -> list[str]:
    """The command that asks `host` to answer: `true` through the agent."""
    return [*agent, host, "true"]


def run_probe(command: list[str], timeout: float = PROBE_TIMEOUT_S) -> str:
    """"" when `command` exited 0 within `timeout`, else why not, in a few words (its last line of stderr). It runs
    in a session of its own: a Ctrl-C to launch's terminal does not end it (a probe killed so would read as a host
    that does not answer), and at the deadline the whole session is ended (an agent that does not exec leaves
    children behind). Its stderr goes to a file: a child that outlives the agent cannot hold launch waiting."""
    with tempfile.TemporaryFile("w+", errors="replace") as err:
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                     start_new_session=True)
        except OSError as exc:
            return f"cannot run {command[0]}: {exc.strerror or exc}"
        try:
            status = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_session(child.pid)
            child.wait()
            return f"no answer within {timeout:g} s"
        if status == 0:
            return ""
        err.seek(0)
        said = next((line.strip() for line in reversed(err.read().splitlines()) if line.strip()), "")
    return f"exit status {status}" + (f": {said[:200]}" if said else "")


def is_here(name: str, here: str) -> bool:
    """Whether host-list name `name` names launch's host `here`: the same name, `localhost`, or the short form of
    the other (node1 for node1.cluster.org; node1.racka and node1.rackb are two hosts)."""
    if name in ("localhost", here):
        return True
    return ("." not in name or "." not in here) and short_name(name) == short_name(here)


def remote_hosts(hosts: Sequence[str], launch_host: str | None = None) -> list[str]:
    """`hosts` less launch's own (is_here), each once: the hosts a probe asks."""
    here = launch_host or socket.gethostname()
    return [name for name in dict.fromkeys(hosts) if not is_here(name, here)]


def probe_hosts(agent: Sequence[str], hosts: Sequence[str], launch_host: str | None = None,
                run: Callable[[list[str]], str] = run_probe) -> dict[str, str]:
    """Each of `hosts` but launch's own (remote_hosts) -> "" where it answered, else why not; PROBE_PARALLEL at a
    time."""
    remote = remote_hosts(hosts, launch_host)
    if not remote:
        return {}
    with ThreadPoolExecutor(min(PROBE_PARALLEL, len(remote)), thread_name_prefix="mpiddp-probe") as pool:
        return dict(zip(remote, pool.map(lambda name: run(probe_command(agent, name)), remote)))


def hosts_to_probe(found: Failure, hosts: Sequence[str], kept_once: set[str], may_keep: bool) -> list[str]:
    """Which hosts a start-up failure asks about: those it names as unreachable and not yet kept once, where a host
    may be kept (`may_keep`: no spare could take its place, --host-strikes 1); after a start past
    --startup-timeout, every host of the attempt; none for any other failure."""
    if found.kind == "unreachable":
        return [host for host in found.hosts if host not in kept_once] if may_keep else []
    if overdue(found):
        return list(hosts)
    return []


def overdue(found: Failure) -> bool:
    """Whether the failure is launch's end of a start past --startup-timeout."""
    return found.kind == "hang" and found.source == "launcher output" and found.message.startswith(STARTUP_OVERDUE_PREFIX)


def weigh(found: Failure, answers: dict[str, str], kept_once: set[str]) -> tuple[Failure, list[str]]:
    """(the failure as the probe's answers leave it, the hosts kept once now). A host named unreachable that
    answered, and was not kept once before, is no longer named; after a start past --startup-timeout the hosts
    that did not answer are named `unreachable`."""
    if found.kind == "unreachable":
        kept = [host for host in found.hosts if host not in kept_once and answers.get(host) == ""]
        if not kept:
            return found, []
        message = f"{found.message}; {', '.join(kept)} {KEPT_ONCE}"
        return replace(found, hosts=tuple(h for h in found.hosts if h not in kept), message=message), kept
    if overdue(found) and answers:
        silent = {host: why for host, why in answers.items() if why}
        if not silent:
            return replace(found, message=f"{found.message}; every host answered launch's probe: none is blamed"), []
        said = "; ".join(f"{host}: {why}" for host, why in silent.items())
        if len(silent) == len(answers):  # no host answered: the probe's own way to hosts may be what fails
            return replace(found, message=f"{found.message}; no host answered launch's probe ({said}), which may "
                                          "not reach hosts the way the launcher does: none is blamed"), []
        return replace(found, kind="unreachable", hosts=tuple(silent),
                       message=f"{found.message}; launch's probe (`true` through the launcher's agent) found "
                               f"{', '.join(silent)} not answering ({said})"), []
    return found, []
