"""After a start that failed: ask each host in question whether it answers, and weigh the answers.

A start-up failure names a host (its daemon "failed to report back", ssh refused it, its daemon came up and ended
before every rank started) or none (a start past --startup-timeout: a daemon or a rank stuck somewhere). Either
way the launcher's account alone cannot tell a host that is down from a start that failed once: Open MPI's own
start-up races now and then, and sshd drops connections beyond its MaxStartups when a launcher opens many at once.
So `launch` asks: it runs `true` on the host through the agent the launcher uses (mpiddp.launch.ender.host_agent),
with a deadline, before it decides.

- A named host that answers is kept for the relaunch, once per launch (`PARDONED`): the start failed, the host did
  not. A host whose start fails again is left out as before (per --host-strikes): a fault of its own that a probe
  cannot see (a daemon that cannot start there) costs one attempt more, never the run.
- After a start past --startup-timeout, a host that does not answer within PROBE_TIMEOUT_S is the one blamed
  (`unreachable`); where every host answers, none is.
The probe runs only when the job recorded no placement (it never started) and the launcher reaches hosts through an
agent (mpirun, mpiexec; not srun).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from mpiddp.launch.diagnose import STARTUP_OVERDUE_PREFIX, Failure
from mpiddp.launch.policy import same_host

PROBE_TIMEOUT_S = 10.0  # a host that has not run `true` by then is taken for one that does not answer
PROBE_PARALLEL = 64  # hosts asked at once (one connection each: a thousand-host start-up failure stays bounded)
PARDONED = "answered launch's probe afterwards (`true` through the launcher's agent): a start that failed, not a " \
           "host that is down; kept once"


def probe_command(agent: Sequence[str], host: str) -> list[str]:
    """The command that asks `host` to answer: `true` through the agent."""
    return [*agent, host, "true"]


def run_probe(command: list[str], timeout: float = PROBE_TIMEOUT_S) -> str:
    """"" when `command` exited 0 within `timeout`, else why not, in a few words (its last line of stderr)."""
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=timeout, text=True, errors="replace")
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return f"cannot run {command[0]}: {exc.strerror or exc}"
    if done.returncode == 0:
        return ""
    said = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "")
    return f"exit status {done.returncode}" + (f": {said[:200]}" if said else "")


def remote_hosts(hosts: Sequence[str], launch_host: str | None = None) -> list[str]:
    """`hosts` less this one (launch's own, or `localhost`), each once: the hosts a probe asks."""
    here = launch_host or socket.gethostname()
    return [name for name in dict.fromkeys(hosts) if name != "localhost" and not same_host(name, here)]


def probe_hosts(agent: Sequence[str], hosts: Sequence[str], launch_host: str | None = None,
                run: Callable[[list[str]], str] = run_probe) -> dict[str, str]:
    """Each of `hosts` -> "" where it answered, else why not; all asked at once (PROBE_PARALLEL at most). This
    host answers without being asked (remote_hosts)."""
    remote = remote_hosts(hosts, launch_host)
    answers = dict.fromkeys(hosts, "")
    if remote:
        with ThreadPoolExecutor(min(PROBE_PARALLEL, len(remote)), thread_name_prefix="mpiddp-probe") as pool:
            for name, why in zip(remote, pool.map(lambda name: run(probe_command(agent, name)), remote)):
                answers[name] = why
    return answers


def hosts_to_probe(found: Failure, hosts: Sequence[str], pardoned: set[str]) -> list[str]:
    """Which hosts a start-up failure asks about: those it names as unreachable and not yet kept once, or after a
    start past --startup-timeout every host of the attempt; none for any other failure."""
    if found.kind == "unreachable":
        return [host for host in found.hosts if host not in pardoned]
    if overdue(found):
        return list(hosts)
    return []


def overdue(found: Failure) -> bool:
    """Whether the failure is launch's end of a start past --startup-timeout."""
    return found.kind == "hang" and found.source == "launcher output" and found.message.startswith(STARTUP_OVERDUE_PREFIX)


def weigh(found: Failure, answers: dict[str, str], pardoned: set[str]) -> tuple[Failure, list[str]]:
    """(the failure as the probe's answers leave it, the hosts kept once now). A host named unreachable that
    answered, and was not kept once before, is no longer named; after a start past --startup-timeout the hosts
    that did not answer are named `unreachable`."""
    if found.kind == "unreachable":
        kept = [host for host in found.hosts if host not in pardoned and answers.get(host) == ""]
        if not kept:
            return found, []
        message = f"{found.message}; {', '.join(kept)} {PARDONED}"
        return replace(found, hosts=tuple(h for h in found.hosts if h not in kept), message=message), kept
    if overdue(found) and answers:
        silent = {host: why for host, why in answers.items() if why}
        if not silent:
            return replace(found, message=f"{found.message}; every host answered launch's probe: none is blamed"), []
        said = "; ".join(f"{host}: {why}" for host, why in silent.items())
        return replace(found, kind="unreachable", hosts=tuple(silent),
                       message=f"{found.message}; launch's probe (`true` through the launcher's agent) found "
                               f"{', '.join(silent)} not answering ({said})"), []
    return found, []
