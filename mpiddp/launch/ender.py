"""Ending a hung rank for the job, from the master (in-job recovery).

Under in-job recovery the hang watchdog ends a rank that stopped answering (SIGKILL), so that MPI declares it
failed and the survivors go on; a rank on the same host does it. Where no other rank runs on that host, the
watchdog asks `launch` instead, with a file in the failures directory naming the host and the pid
(mpiddp.failure.ask_to_end). `launch` reaches the host the way the launcher does: through the agent the user
named for it, however it was named (host_agent), else ssh, with the options Open MPI gives it (plm_ssh_args:
host_command), and runs `kill -KILL PID` there. Where that fails
(the host cannot be reached), one line says so, and the job's own fallback stands: the watchdog ends the job.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mpiddp import failure

# Every name under which Open MPI (4: ORTE's plm_rsh_agent; 5: PRRTE's plm_ssh_agent, with plm_rsh_agent kept as
# its alias) and MPICH's Hydra (-launcher-exec, formerly -bootstrap-exec) take the program that reaches a host.
# The launcher's command line wins over the environment, as it does for the launchers themselves.
AGENT_PARAMS = ("plm_ssh_agent", "plm_rsh_agent")
MCA_FLAGS = ("--mca", "-mca", "--prtemca", "-prtemca", "--omca", "-omca", "--gmca", "-gmca")
HYDRA_FLAGS = ("-launcher-exec", "--launcher-exec", "-bootstrap-exec", "--bootstrap-exec")
AGENT_ENV = ("PRTE_MCA_plm_ssh_agent", "PRTE_MCA_plm_rsh_agent", "OMPI_MCA_plm_ssh_agent", "OMPI_MCA_plm_rsh_agent",
             "HYDRA_LAUNCHER_EXEC", "HYDRA_BOOTSTRAP_EXEC")
# The options Open MPI 5 puts between the agent and the host (`--mca plm_ssh_args "-p 2222"`: sshd elsewhere, as in
# containers), read as PRRTE 3.0.14 reads them (checked with a logging agent): plm_ssh_args on the command line
# (the last given), else PRTE_MCA_plm_ssh_args, else plm_rsh_args on the command line; PRTE_MCA_plm_rsh_args and
# the OMPI_MCA_ names reach no agent. Its parameter files are not read here.
AGENT_ARGS_PARAM, AGENT_ARGS_ALIAS, AGENT_ARGS_ENV = "plm_ssh_args", "plm_rsh_args", "PRTE_MCA_plm_ssh_args"
POLL_S = 0.5  # how often the failures directory is looked at while the job runs (a listing: cheap)
END_TIMEOUT_S = 30.0  # the most one `kill` through the agent may take (an unreachable host: the hang stands)


def host_agent(launcher_args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The command that runs a command on another host, as the launcher does: the agent named on the launcher's
    command line (`--mca`/`--prtemca plm_ssh_agent|plm_rsh_agent X`, `-launcher-exec X`; the last one given),
    else in the environment (AGENT_ENV, in that order), else ssh. Open MPI takes a list (`ssh : rsh`): its first."""
    agent = ""
    args = list(launcher_args)
    for index, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name in HYDRA_FLAGS and (inline or index + 1 < len(args)):
            agent = inline or args[index + 1]
        elif arg in MCA_FLAGS and index + 2 < len(args) and args[index + 1] in AGENT_PARAMS:
            agent = args[index + 2]
    if not agent:
        agent = next((env[name] for name in AGENT_ENV if env.get(name, "").strip()), "ssh")
    return shlex.split(agent.split(":")[0].strip()) or ["ssh"]


def agent_args(launcher_args: Sequence[str], env: Mapping[str, str], flavour: str = "openmpi") -> list[str]:
    """The options Open MPI gives its agent before the host (AGENT_ARGS_PARAM), split on spaces as PRRTE splits
    them (quotes are no quoting there); none for MPICH, whose Hydra takes its agent whole from -launcher-exec."""
    if flavour != "openmpi":
        return []
    given: dict[str, str] = {}
    args = list(launcher_args)
    for index, arg in enumerate(args):
        if arg in MCA_FLAGS and index + 2 < len(args) and args[index + 1] in (AGENT_ARGS_PARAM, AGENT_ARGS_ALIAS):
            given[args[index + 1]] = args[index + 2]
    value = given.get(AGENT_ARGS_PARAM) or env.get(AGENT_ARGS_ENV, "").strip() or given.get(AGENT_ARGS_ALIAS, "")
    return value.split()


def host_command(launcher_args: Sequence[str], env: Mapping[str, str], flavour: str = "openmpi") -> list[str]:
    """What runs a command on another host as the launcher reaches it: the agent (host_agent) and the options
    Open MPI gives it (agent_args); the host and the command follow."""
    return [*host_agent(launcher_args, env), *agent_args(launcher_args, env, flavour)]


def end_command(agent: Sequence[str], host: str, pid: int) -> list[str]:
    """The command that ends process `pid` on `host`: here directly when `host` is this host."""
    kill = ["kill", "-KILL", str(pid)]
    if host in ("localhost", socket.gethostname()):
        return kill
    return [*agent, host, " ".join(kill)]


class Ender:
    """While an attempt runs: ends each hung rank the job asks launch to end, once (a thread polling the
    failures directory). `say` tells the user; `run` runs a command (tests pass a fake)."""

    def __init__(self, directory: Path, agent: Sequence[str], say: Callable[[str], None],
                 run: Callable[[list[str]], int] | None = None) -> None:
        self.directory, self.agent, self.say = directory, list(agent), say
        self.run = run or _run
        self.done: set[str] = set()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="mpiddp-ender", daemon=True)

    def __enter__(self) -> Ender:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(END_TIMEOUT_S)

    def _watch(self) -> None:
        while not self.stopped.wait(POLL_S):
            self.once()

    def once(self) -> None:
        """End every process asked for and not yet ended."""
        for name, asked in failure.to_end(self.directory):
            if name in self.done:
                continue
            self.done.add(name)
            command = end_command(self.agent, asked["host"], asked["pid"])
            status = self.run(command)
            said = (f"ending hung rank {asked.get('rank', '?')} (pid {asked['pid']}) on {asked['host']} for in-job "
                    f"recovery: {' '.join(command)}")
            if status != 0:  # the job's watchdog waits for the rank to go, then ends the job itself
                said += (f" (exit status {status}: cannot end it through {command[0]}; the job's hang fallback "
                         "ends the job)")
            self.say(said)


def daemon_end_commands(agent: Sequence[str], hosts: Sequence[str], launch_host: str, launcher_pid: int) -> list[list[str]]:
    """The commands that end, on each other host, what Open MPI's launcher `launcher_pid` started there: its
    daemon (prted names the job `prterun-LAUNCH_HOST-PID@0` on its command line) and the ranks (theirs and the
    spawned ones' PMIX_NAMESPACE). Run when that launcher died by a signal, whose daemons and ranks can outlive
    it (seen: a prted and a grown rank on the spare after mpirun's SIGABRT past the job's end). Only that
    launcher's processes match."""
    job = f"prterun-{launch_host.split('.')[0]}[^ ]*-{launcher_pid}@"
    script = (f"pkill -KILL -f 'ess_base_nspace {job}'; for p in /proc/[0-9]*; do "
              f"grep -qszE '^PMIX_NAMESPACE={job}' $p/environ && kill -KILL ${{p#/proc/}}; done; true")
    return [[*agent, host, script] for host in dict.fromkeys(hosts)
            if host not in ("localhost", launch_host, launch_host.split(".")[0])]


def end_daemons(agent: Sequence[str], hosts: Sequence[str], launcher_pid: int,
                run: Callable[[list[str]], int] | None = None) -> None:
    """End the daemons a dead launcher left on `hosts` (daemon_end_commands), all hosts at once; never raises."""
    run = run or _run
    threads = [threading.Thread(target=run, args=(command,), daemon=True)
               for command in daemon_end_commands(agent, hosts, socket.gethostname(), launcher_pid)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(END_TIMEOUT_S + 1)


def _run(command: list[str]) -> int:
    try:
        return subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=END_TIMEOUT_S).returncode
    except (OSError, subprocess.TimeoutExpired):
        return -1


def end_session(session: int) -> None:
    """SIGKILL every process left in `session` (the launcher's: its pid), wherever it moved in the process tree.
    Off Linux (no /proc), the launcher's process group only."""
    proc = Path("/proc")
    if not proc.is_dir():
        kill_group(session)
        return
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.getsid(int(entry.name)) == session:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours
            continue


def kill_group(group: int) -> None:
    """SIGKILL process group `group`, if any is left."""
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:  # none left
        pass
