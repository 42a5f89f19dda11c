"""Ending a hung rank for the job, from the master (in-job recovery).

Under in-job recovery the hang watchdog ends a rank that stopped answering (SIGKILL), so that MPI declares it
failed and the survivors go on; a rank on the same host does it. Where no other rank runs on that host, the
watchdog asks `launch` instead, with a file in the failures directory naming the host and the pid
(mpiddp.failure.ask_to_end). `launch` reaches the host the way the launcher does: Open MPI's rsh agent where one
is set (`--mca plm_rsh_agent`, OMPI_MCA_/PRTE_MCA_plm_rsh_agent), else ssh, and runs `kill -KILL PID` there.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mpiddp import failure

AGENT_PARAM = "plm_rsh_agent"
AGENT_ENV = ("OMPI_MCA_plm_rsh_agent", "PRTE_MCA_plm_rsh_agent")
MCA_FLAGS = ("--mca", "-mca", "--prtemca", "--omca")
POLL_S = 0.5  # how often the failures directory is looked at while the job runs (a listing: cheap)
END_TIMEOUT_S = 30.0  # the most one `kill` through the agent may take (an unreachable host: the hang stands)


def rsh_agent(launcher_args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The command that runs a command on another host, as the launcher does: the rsh agent on the launcher's
    command line, else in the environment, else ssh (Open MPI's "ssh : rsh" list: its first)."""
    agent = ""
    for index, arg in enumerate(launcher_args[:-2]):
        if arg in MCA_FLAGS and launcher_args[index + 1] == AGENT_PARAM:
            agent = launcher_args[index + 2]
    if not agent:
        agent = next((env[name] for name in AGENT_ENV if env.get(name)), "ssh")
    return shlex.split(agent.split(":")[0].strip()) or ["ssh"]


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
            self.say(f"ending hung rank {asked.get('rank', '?')} (pid {asked['pid']}) on {asked['host']} for in-job "
                     f"recovery: {' '.join(command)}" + ("" if status == 0 else f" (exit status {status})"))


def _run(command: list[str]) -> int:
    try:
        return subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=END_TIMEOUT_S).returncode
    except (OSError, subprocess.TimeoutExpired):
        return -1
